"""The connection budget's arithmetic (daemon/admission.py) and its flag; the attacks it answers are
played against a real daemon in tests/test_hostile.py."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
from conftest import DAEMON_CMD, daemon_env

from katsubushi_py.daemon.admission import Admission


def make(max_connections: int = 10, max_unauthenticated: int = 5, handshakes: int = 0, connections: int = 0):
    server = SimpleNamespace(_handshakes=set(range(handshakes)))
    stats = SimpleNamespace(rejected_connections=0)
    admission = Admission(max_connections, max_unauthenticated, set(range(connections)), lambda: [server], stats)
    return admission, server, stats


def test_handshakes_count_toward_max_connections() -> None:
    admission, server, stats = make(max_connections=10, max_unauthenticated=10, handshakes=4, connections=5)
    assert admission.admit_handshake()  # 9 of 10
    server._handshakes.add(99)
    assert not admission.admit_handshake()  # 10 of 10: a connection or a handshake, each takes a place
    assert not admission.admit(needs_login=False)
    assert stats.rejected_connections == 2


def test_unauthenticated_share() -> None:
    admission, _, stats = make(max_connections=10, max_unauthenticated=5, handshakes=3)
    admission.unauthenticated = 1
    assert admission.admit_handshake() and admission.admit(needs_login=True)  # 4 of 5
    admission.unauthenticated = 2
    assert not admission.admit_handshake()
    assert not admission.admit(needs_login=True)
    assert admission.admit(needs_login=False)  # the authenticated part of the connections is free
    assert stats.rejected_connections == 2 and admission.refused_unauthenticated == 2
    fields = dict(admission.stat_fields())
    assert fields["tls_handshakes"] == 3 and fields["unauthenticated_connections"] == 2


def test_refusals_are_logged_at_most_every_ten_seconds(caplog: pytest.LogCaptureFixture) -> None:
    admission, _, _ = make(max_connections=1, connections=1)
    for _ in range(50):
        admission.admit(needs_login=False)
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "--max-connections reached" in lines[0].getMessage()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--max-unauthenticated", "0"], "invalid --max-unauthenticated 0: must be >= 1"),
        (["--max-unauthenticated", "x"], "invalid --max-unauthenticated 'x': not an integer"),
        (
            ["--max-connections", "10", "--max-unauthenticated", "11"],
            "--max-unauthenticated 11 is more than --max-connections 10",
        ),
        # --login-timeout closes memcached connections not logged in (--auth-file) and HTTP and gRPC
        # connections with no request with a good token yet (--token-file): it needs one of the two.
        (["--login-timeout", "5s"], "--login-timeout needs --auth-file or --token-file"),
    ],
)
def test_bad_max_unauthenticated_is_one_line_and_exit_2(args: list[str], said: str) -> None:
    proc = subprocess.run(
        [*DAEMON_CMD, "--worker-id", "1", "--port", "0", *args], capture_output=True, text=True, env=daemon_env()
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"katsubushi-py: error: {said}"]
