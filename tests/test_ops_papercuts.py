"""What a newcomer running the daemon the first time tripped over (issue 25), each checked on a real
daemon: ``stats settings`` names the state file in use; a leased daemon that stops issuing says so
once, and once when it resumes; the pure-Python hot path and a listener beyond loopback are start-up
warnings; pymemcache's ``gets`` needs ``--gets-cas``; the /metrics docs name every protocol label."""

from __future__ import annotations

import importlib.util
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import DAEMON_CMD, DaemonFactory, daemon_env, free_port, wait_for_port, wait_for_unix
from lease_helpers import get, ids, start_leased, wait_until

from katsubushi_py.daemon import server
from katsubushi_py.daemon.tls import TlsConfig

ROOT = Path(__file__).resolve().parent.parent


def stats_settings(sock: socket.socket) -> dict[str, str]:
    sock.sendall(b"stats settings\r\n")
    data = b""
    while not data.endswith(b"END\r\n"):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    lines = data.decode().split("\r\n")[:-2]
    return {line.split(" ")[1]: line.split(" ", 2)[2] for line in lines}


# -- stats settings --------------------------------------------------------------------------------
def test_stats_settings_names_the_state_file_in_the_state_directory(daemons: DaemonFactory, tmp_path: Path) -> None:
    """It showed ``state_file NULL`` whenever the state directory (the default) was in use."""
    state = tmp_path / "state"
    d = daemons.start("--state-dir", str(state), worker_id=5)
    with d.connect() as s:
        settings = stats_settings(s)
    assert settings["state_file"] == str(state / "worker-5.state")
    assert settings["state_dir"] == str(state)
    assert (state / "worker-5.state").exists()


def test_stats_settings_with_one_state_file_and_with_none(daemons: DaemonFactory, tmp_path: Path) -> None:
    one = daemons.start("--state-file", str(tmp_path / "one.state"), worker_id=6)
    with one.connect() as s:
        settings = stats_settings(s)
    assert (settings["state_file"], settings["state_dir"]) == (str(tmp_path / "one.state"), "NULL")
    none = daemons.start("--no-state-file", worker_id=7)
    with none.connect() as s:
        settings = stats_settings(s)
    assert (settings["state_file"], settings["state_dir"]) == ("NULL", "NULL")


# -- a leased daemon that stops issuing ------------------------------------------------------------
@pytest.mark.once
def test_a_fenced_daemon_says_once_that_it_stopped_and_once_that_it_resumed(
    daemons: DaemonFactory, redis_server: object
) -> None:
    """Redis paused (SIGSTOP) past the lease's deadline: one ERROR line "stopped issuing: lease on
    worker id N expired at ...", requests refused meanwhile; Redis back: one line saying issuing
    resumed, and IDs again. (Before, only the renew warnings said anything, every 10 s.)"""
    d = start_leased(daemons, redis_server.url)  # type: ignore[attr-defined]
    worker = int(next(line for line in d.stderr().splitlines() if "leased worker id" in line).split()[5])
    ids(d)
    redis_server.pause()  # type: ignore[attr-defined]
    try:
        wait_until(lambda: "stopped issuing" in d.stderr(), timeout=10)
        refused = get(d)
        assert isinstance(refused, bytes) and refused.startswith(b"SERVER_ERROR worker id lease not confirmed")
        time.sleep(1.5)  # more failed renews: still one line
    finally:
        redis_server.resume()  # type: ignore[attr-defined]
    wait_until(lambda: "resumed issuing" in d.stderr(), timeout=10)
    assert len(ids(d, 3)) == 3
    log = d.stderr()
    stopped = [line for line in log.splitlines() if "stopped issuing" in line]
    resumed = [line for line in log.splitlines() if "resumed issuing" in line]
    assert len(stopped) == 1 and len(resumed) == 1, log
    assert re.search(
        rf" ERROR stopped issuing: lease on worker id {worker} expired at \d{{4}}-\d\d-\d\dT[\d:.]+Z \(no renew"
        rf" confirmed by redis://127\.0\.0\.1:\d+/0 \(ns=t\) since \d{{4}}-\d\d-\d\dT[\d:.]+Z\); requests answer"
        " SERVER_ERROR until a renew succeeds$",
        stopped[0],
    ), stopped[0]
    assert re.search(
        rf" INFO resumed issuing under worker id {worker}: a renew confirmed the lease \(stopped for \d+\.\ds\)$",
        resumed[0],
    ), resumed[0]
    assert log.index("stopped issuing") < log.index("resumed issuing")


# -- start-up warnings -----------------------------------------------------------------------------
PURE_WARNING = (
    "WARNING running the pure-Python hot path (KATSUBUSHI_NO_EXTENSIONS is set): expect about 0.6-0.75x"
    " memcached's requests/s one key at a time instead of about 1.0x, and a fifth to a half of the compiled"
    " path's IDs/s with pipelined and multi-key GETs (bench/RESULTS.md)"
)


def implementation(d: object) -> str:
    with d.connect() as s:  # type: ignore[attr-defined]
        s.sendall(b"STATS\r\n")
        data = b""
        while not data.endswith(b"END\r\n"):
            data += s.recv(65536)
    return re.search(rb"STAT implementation (\w+)\r\n", data).group(1).decode()  # type: ignore[union-attr]


def test_the_pure_python_path_is_a_startup_warning_with_its_cost(daemons: DaemonFactory) -> None:
    """Set explicitly for the process, so this holds in both passes of the suite."""
    d = daemons.start(env={"KATSUBUSHI_NO_EXTENSIONS": "1"})
    assert implementation(d) == "python"
    wait_until(lambda: "WARNING running the pure-Python" in d.stderr(), timeout=5)
    assert [line.split(" ", 1)[1] for line in d.stderr().splitlines() if "pure-Python" in line] == [PURE_WARNING]


def test_the_compiled_path_logs_no_such_warning(daemons: DaemonFactory) -> None:
    if importlib.util.find_spec("katsubushi_py._speedups") is None:
        pytest.skip("the compiled hot path is not built here")
    d = daemons.start(env={"KATSUBUSHI_NO_EXTENSIONS": "0"})
    assert implementation(d) == "compiled"
    d.stop()
    log = d.stderr()
    assert "serving worker id" in log and "WARNING" not in log, log


@pytest.mark.parametrize(
    ("why", "advice"),
    [
        ("not built (No module named 'katsubushi_py._speedups')", True),
        ("free-threaded CPython (the compiled fast paths rely on the GIL)", False),
    ],
)
def test_the_warning_says_why_and_what_to_do(monkeypatch: pytest.MonkeyPatch, why: str, advice: bool) -> None:
    monkeypatch.setattr(server, "IMPLEMENTATION", "python")
    monkeypatch.setattr(server, "WHY_NOT_COMPILED", why)
    [line] = server.startup_warnings(["127.0.0.1:11212"])
    assert line.startswith(f"running the pure-Python hot path ({why}): expect about 0.6-0.75x memcached's")
    assert line.endswith("(gcc, python3-dev) to build it") is advice


@pytest.mark.parametrize(
    ("addresses", "exposed"),
    [
        (["127.0.0.1:11212", "/run/katsubushi-py.sock", "http://[::1]:8080", "grpc://localhost:50051"], []),
        (["@abstract", "127.0.0.2:11212"], []),
        (["0.0.0.0:11212", "/run/k.sock", "http://0.0.0.0:8080"], ["0.0.0.0:11212", "http://0.0.0.0:8080"]),
        (["[::]:11212", "grpc://10.0.0.5:50051"], ["[::]:11212", "grpc://10.0.0.5:50051"]),
        (["grpc://ids.example:50051"], ["grpc://ids.example:50051"]),
    ],
)
def test_which_addresses_count_as_beyond_loopback(
    monkeypatch: pytest.MonkeyPatch, addresses: list[str], exposed: list[str]
) -> None:
    monkeypatch.setattr(server, "IMPLEMENTATION", "compiled")
    lines = server.startup_warnings(addresses)
    if not exposed:
        assert lines == []
    else:
        assert lines == [
            f"listening beyond loopback ({', '.join(exposed)}) with no authentication or encryption: anyone"
            " who can reach these addresses can take IDs and read its stats, in clear text; turn on TLS"
            " (--tls-cert, --tls-key) and require client certificates (--tls-ca, --tls-verify require) or"
            " logins: --auth-file (memcached), --token-file (HTTP, gRPC); or allow only your applications (a"
            " firewall, a private network, a Kubernetes NetworkPolicy)"
        ]
        # With TLS but no client certificates required, the warning says what is still missing.
        tls = TlsConfig(cert="server.pem")
        [line] = server.startup_warnings(addresses, tls)
        assert "with TLS but no authentication" in line and "--tls-verify require" in line
        assert server.startup_warnings(addresses, TlsConfig(cert="s.pem", ca="ca.pem", verify="require")) == []


def in_new_network_namespace(command: list[str]) -> list[str]:
    """``command`` in a network namespace of its own with only loopback up: 0.0.0.0 there exposes nothing."""
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]


@pytest.mark.parametrize("workers", [1, 2])
def test_listening_on_every_interface_warns_that_there_is_no_authentication(short_tmp: Path, workers: int) -> None:
    """``--host 0.0.0.0``, in a private network namespace (tests never listen beyond loopback): one
    warning naming the exposed listeners and not the unix socket, also from a ``--workers``
    supervisor (once, not once per process)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare (util-linux) and ip (iproute2)")
    probe = subprocess.run(in_new_network_namespace(["true"]), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    sock = str(short_tmp / "ids.sock")
    port, http = free_port(), free_port()
    argv = [*DAEMON_CMD, "--worker-id", "8", "--host", "0.0.0.0", "--port", str(port), "--http-port", str(http)]
    argv += ["--sock", sock, "--workers", str(workers)]
    log = short_tmp / "daemon.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            in_new_network_namespace(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=daemon_env(short_tmp / "state"),
        )
    try:
        wait_for_unix(sock, proc)
        wait_until(lambda: "beyond loopback" in log.read_text(), timeout=10)
        time.sleep(0.3 * workers)  # every process has started: none says it again
    finally:
        proc.terminate()
        proc.wait(10)
    warnings = [line for line in log.read_text().splitlines() if "beyond loopback" in line]
    assert len(warnings) == 1, log.read_text()
    exposed = f"WARNING listening beyond loopback (0.0.0.0:{port}, http://0.0.0.0:{http}) with no authentication"
    assert exposed in warnings[0]
    assert sock not in warnings[0]


def test_a_daemon_on_loopback_does_not_warn_about_it(daemons: DaemonFactory, short_tmp: Path) -> None:
    d = daemons.start("--http-port", str(free_port()), sock=str(short_tmp / "ids.sock"))
    d.stop()
    assert "serving worker id" in d.stderr() and "beyond loopback" not in d.stderr()


# -- clients that need --gets-cas ------------------------------------------------------------------
def test_pymemcache_gets_needs_gets_cas_and_the_readme_says_so(daemons: DaemonFactory) -> None:
    """katsubushi's GETS reply has no CAS field, so pymemcache's ``gets`` fails without --gets-cas."""
    from pymemcache.client.base import Client

    plain = daemons.start(worker_id=9)
    client = Client(("127.0.0.1", plain.port), timeout=5)
    with pytest.raises(ValueError):
        client.gets("a")
    client.close()
    with_cas = daemons.start("--gets-cas", worker_id=10)
    client = Client(("127.0.0.1", with_cas.port), timeout=5)
    value, cas = client.gets("a")
    client.close()
    assert int(value) == int(cas) > 0
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "need the daemon's `--gets-cas` (go-katsubushi sends none): pymemcache's `gets` and `gets_many`" in readme


# -- /metrics docs ---------------------------------------------------------------------------------
def test_the_metrics_docs_name_every_protocol_label(daemons: DaemonFactory) -> None:
    http = free_port()
    d = daemons.start("--http-port", str(http))
    wait_for_port(http, d.proc)  # the HTTP listener opens just after the memcached one
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5) as response:
        exposition = response.read().decode()
    exported = set(re.findall(r'^katsubushi_requests_total\{protocol="(\w+)"\}', exposition, re.M))
    assert {"text", "binary", "meta", "http"} <= exported
    row = next(
        line
        for line in (ROOT / "docs" / "operations.md").read_text().splitlines()
        if line.startswith("| `katsubushi_requests_total{protocol}`")
    )
    documented = set(re.findall(r"`(\w+)`", row.split("per protocol", 1)[1].split(";")[0]))
    assert documented == exported | {"grpc"}  # grpc: with --grpc-port
