"""Worker ids without Redis: ``--worker-id-from ordinal`` and ``--worker-id-from ip``.

The daemon runs as a real process and the worker id is read back from the IDs it issues. The ``ip``
method is checked against the kernel's own answer (``ip route get``) on this machine, and inside
network namespaces made for the test (a known address; a host with only loopback).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import DAEMON_CMD, DaemonFactory, decode, free_port, parse_values, recv_until, wait_for_unix

from katsubushi_py.ids.layout import Layout
from katsubushi_py.worker_ids import WorkerIdError, default_route_ipv4, derive, from_ipv4, from_ordinal

LAYOUT = Layout()


def one_worker_id(daemon) -> int:  # type: ignore[no-untyped-def]
    with daemon.connect() as s:
        s.sendall(b"GET a\r\n")
        [(_, id_)] = parse_values(recv_until(s, b"END\r\n"))
    return decode(id_)[1]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("WORKER_ID", "REDIS"))}
    full_env.update(env or {})
    return subprocess.run(
        [*DAEMON_CMD, *args, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=30,
        env=full_env,
        stdin=subprocess.DEVNULL,
    )


# -- ordinal ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hostname", "offset", "expected"),
    [
        ("katsubushi-3", 0, 3),
        ("katsubushi-0", 0, 0),
        ("web-007", 0, 7),
        ("katsubushi-3.katsubushi.default.svc.cluster.local", 0, 3),
        ("ids-12", 100, 112),
        ("ids-12", -12, 0),
        ("compose-project-ids-1023", 0, 1023),
    ],
)
def test_ordinal_is_the_trailing_dash_number_of_the_first_label(hostname: str, offset: int, expected: int) -> None:
    derived = from_ordinal(hostname, offset, LAYOUT)
    assert derived.worker_id == expected
    assert hostname in derived.source and f"offset {offset}" in derived.source


@pytest.mark.parametrize(
    ("hostname", "message"),
    [
        ("web03", "no trailing number '-N'"),  # not a -N segment: refused rather than guessed
        ("katsubushi-7c9d8f6b5-x9k2b", "no trailing number"),  # a Deployment's random pod suffix
        ("katsubushi-7c9d8f6b5-x9k22", "no trailing number"),  # ... even when it ends in a digit
        ("db-3x.example.com", "no trailing number"),
        ("app.example-2", "no trailing number"),  # the number must be in the first label
        ("ip-10-0-1-23", "is an address, not an ordinal"),  # EC2: the last octet repeats across subnets
        ("", "no trailing number"),
    ],
)
def test_ordinal_refuses_names_without_a_trailing_number(hostname: str, message: str) -> None:
    with pytest.raises(WorkerIdError, match=message):
        from_ordinal(hostname, 0, LAYOUT)


@pytest.mark.parametrize(("hostname", "offset"), [("ids-1024", 0), ("ids-1000", 24), ("ids-2", -3)])
def test_ordinal_out_of_range_after_the_offset(hostname: str, offset: int) -> None:
    with pytest.raises(WorkerIdError, match=r"out of range 0\.\.1023 \(10 worker bits\)"):
        from_ordinal(hostname, offset, LAYOUT)


def test_ordinal_range_follows_the_layout() -> None:
    small = Layout(worker_bits=4, sequence_bits=12)
    assert from_ordinal("ids-15", 0, small).worker_id == 15
    with pytest.raises(WorkerIdError, match=r"out of range 0\.\.15"):
        from_ordinal("ids-16", 0, small)


def test_daemon_takes_its_worker_id_from_the_hostname_and_logs_where_from(daemons: DaemonFactory) -> None:
    d = daemons.start("--worker-id-from", "ordinal", "--hostname", "katsubushi-5", worker_id=None)
    assert one_worker_id(d) == 5
    d.wait_for_log("worker id 5 from hostname 'katsubushi-5' (ordinal 5 + offset 0)")


def test_environment_forms_and_offset(daemons: DaemonFactory) -> None:
    d = daemons.start(
        "--hostname", "ids-2", worker_id=None, env={"WORKER_ID_FROM": "ordinal", "WORKER_ID_OFFSET": "40"}
    )
    assert one_worker_id(d) == 42
    d.wait_for_log("worker id 42 from hostname 'ids-2' (ordinal 2 + offset 40)")


def test_default_hostname_is_the_kernels(daemons: DaemonFactory) -> None:
    """Without --hostname the daemon reads gethostname(); here that name's own rule decides."""
    import socket

    name = socket.gethostname()
    try:
        expected = from_ordinal(name, 0, LAYOUT).worker_id
    except WorkerIdError as exc:
        result = run_cli("--worker-id-from", "ordinal")
        assert result.returncode == 2
        assert result.stderr.strip() == f"katsubushi-py: error: --worker-id-from ordinal: {exc}"
        return
    d = daemons.start("--worker-id-from", "ordinal", worker_id=None)
    assert one_worker_id(d) == expected


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ("--worker-id-from", "ordinal", "--hostname", "web03"),
            {},
            "--worker-id-from ordinal: hostname 'web03' has no trailing number '-N'",
        ),
        (
            ("--worker-id-from", "ordinal", "--hostname", "ids-1000", "--worker-id-offset", "30"),
            {},
            "ordinal 1000 of hostname 'ids-1000' + offset 30 = 1030 is out of range 0..1023",
        ),
        (("--worker-id-from", "ordinal", "--hostname", "ids-1"), {"WORKER_ID_OFFSET": "x"}, "not an integer"),
        (("--worker-id-from", "uuid"), {}, "invalid choice: 'uuid'"),
        ((), {"WORKER_ID_FROM": "mac"}, "invalid worker id method 'mac': use ordinal or ip"),
        (("--worker-id", "1", "--worker-id-from", "ip"), {}, "use either --worker-id or --worker-id-from ip"),
        (("--worker-id-from", "ordinal", "--hostname", "a-1"), {"WORKER_ID": "2"}, "use either --worker-id"),
        (("--worker-id-from", "ip", "--redis", "redis://127.0.0.1:1"), {}, "use either --worker-id-from ip or --redis"),
        (("--worker-id", "3", "--worker-id-offset", "1"), {}, "--worker-id-offset needs --worker-id-from ordinal"),
        (("--worker-id", "3", "--hostname", "a-1"), {}, "--hostname needs --worker-id-from ordinal"),
        (("--worker-id-from", "ip", "--hostname", "a-1"), {}, "--hostname applies to --worker-id-from ordinal only"),
        ((), {}, "set --worker-id N (or WORKER_ID), --worker-id-from ordinal|ip, or --redis URL"),
    ],
)
def test_bad_worker_id_sources_are_one_line(args: tuple[str, ...], env: dict[str, str], message: str) -> None:
    result = run_cli(*args, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("katsubushi-py: error: "), result.stderr
    assert message in lines[0]


# -- ip --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "worker_bits", "expected"),
    [
        ("10.0.1.5", 10, (1 << 8) | 5),
        ("10.0.5.5", 10, (1 << 8) | 5),  # the collision the README warns about: same low 10 bits
        ("192.168.3.255", 10, (3 << 8) | 255),
        ("172.16.200.1", 10, ((200 & 3) << 8) | 1),
        ("10.20.30.77", 6, 77 & 63),
        ("10.20.30.77", 16, (30 << 8) | 77),
        ("10.20.30.77", 0, 0),
    ],
)
def test_ip_takes_the_low_worker_bits(address: str, worker_bits: int, expected: int) -> None:
    layout = Layout(worker_bits=worker_bits, sequence_bits=22 - worker_bits if worker_bits <= 16 else 6)
    derived = from_ipv4(address, layout)
    assert derived.worker_id == expected
    assert address in derived.source and f"low {worker_bits} bits" in derived.source


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.1.1", "0.0.0.0"])
def test_ip_refuses_addresses_every_host_has(address: str) -> None:
    with pytest.raises(WorkerIdError, match="which every host has"):
        from_ipv4(address, LAYOUT)


def kernel_route_source() -> str | None:
    """The kernel's own answer, from iproute2, independent of the daemon's UDP-socket lookup."""
    if shutil.which("ip") is None:
        return None
    out = subprocess.run(["ip", "-4", "route", "get", "198.51.100.1"], capture_output=True, text=True).stdout
    words = out.split()
    return words[words.index("src") + 1] if "src" in words else None


def test_ip_on_this_machine_is_the_default_routes_source_address(daemons: DaemonFactory) -> None:
    source = kernel_route_source()
    if source is None:
        pytest.skip("no iproute2 or no IPv4 default route on this machine")
    assert default_route_ipv4() == source
    expected = from_ipv4(source, LAYOUT).worker_id
    assert derive("ip", LAYOUT).worker_id == expected
    d = daemons.start("--worker-id-from", "ip", worker_id=None)
    assert one_worker_id(d) == expected
    assert f"worker id {expected} from IPv4 address {source} (source of the default route)" in d.stderr()


def in_new_network_namespace(setup: str, command: list[str]) -> list[str]:
    """``command`` in a fresh network namespace prepared by the shell commands ``setup``."""
    return ["unshare", "--net", "sh", "-c", f'{setup} && exec "$@"', "sh", *command]


@pytest.fixture
def netns() -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare (util-linux) and ip (iproute2)")
    probe = subprocess.run(in_new_network_namespace("ip link set lo up", ["true"]), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")


def test_ip_in_a_namespace_with_a_known_address(netns: None, daemons: DaemonFactory, short_tmp: Path) -> None:
    """A host whose default route leaves from 10.20.30.77: worker id = its low 10 bits = 589.

    The daemon listens on a unix socket, which the test reaches from outside the namespace."""
    sock = str(short_tmp / "ids.sock")
    setup = (
        "ip link set lo up && ip link add kp0 type veth peer name kp1 && ip addr add 10.20.30.77/24 dev kp0"
        " && ip link set kp0 up && ip link set kp1 up && ip route add default via 10.20.30.1"
    )
    argv = in_new_network_namespace(setup, [*DAEMON_CMD, "--worker-id-from", "ip", "--sock", sock])
    log = short_tmp / "daemon.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    try:
        try:
            wait_for_unix(sock, proc)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}: {log.read_text()}") from None
        import socket

        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(sock)
            s.sendall(b"GET a b\r\n")
            ids = [id_ for _, id_ in parse_values(recv_until(s, b"END\r\n"))]
        assert {decode(id_)[1] for id_ in ids} == {(30 & 3) << 8 | 77} == {589}
        assert "worker id 589 from IPv4 address 10.20.30.77 (source of the default route)" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


def test_ip_on_a_host_with_only_loopback_is_refused(netns: None) -> None:
    argv = in_new_network_namespace("ip link set lo up", [*DAEMON_CMD, "--worker-id-from", "ip"])
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("katsubushi-py: error: --worker-id-from ip: no IPv4 default route")
    assert "a host with only loopback?" in result.stderr and len(result.stderr.strip().splitlines()) == 1
