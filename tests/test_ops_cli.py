"""The command line an operator meets first: --help and help, id-at now, missing directories, and
``katsubushi-py health`` against real daemons (on a port flag, a port from the environment, a unix
socket, both, and read from the daemon's process with --pid)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DAEMON_CMD, DaemonFactory, decode, free_port

from katsubushi_py.cli import COMMANDS
from katsubushi_py.ids.layout import KATSUBUSHI_EPOCH_MS


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k.upper() not in {"WORKER_ID", "PORT", "SOCK"}}
    full_env.update(env or {})
    return subprocess.run(
        [*DAEMON_CMD, *args], capture_output=True, text=True, timeout=30, env=full_env, stdin=subprocess.DEVNULL
    )


# -- help ------------------------------------------------------------------------------------------
def test_help_lists_every_command_with_one_line() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    commands = text[text.index("commands:\n") :].split("\n\n", 1)[0].splitlines()[1:]
    assert [line.split()[0] for line in commands] == list(COMMANDS)
    for line, name in zip(commands, COMMANDS, strict=True):
        summary = line.split(None, 1)[1]
        assert len(summary) > 10, f"{name} has no summary (give its function a docstring)"
    for name in ("decode", "id-at", "partitions", "lease", "health", "help"):
        assert name in COMMANDS
    assert "--worker-id-from" in text and "--worker-id N" in text.splitlines()[0]


def test_help_without_a_command_is_the_same_as_dash_dash_help() -> None:
    assert run("help").stdout == run("--help").stdout


def test_help_lease_shows_the_lease_actions() -> None:
    result = run("help", "lease")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: katsubushi-py lease")
    for action in ("init", "stats", "list"):
        assert action in result.stdout
    assert result.stdout == run("lease", "--help").stdout


@pytest.mark.parametrize("name", ["health", "id-at", "decode", "partitions", "serve"])
def test_help_for_each_command(name: str) -> None:
    result = run("help", name)
    assert result.returncode == 0 and result.stdout.startswith("usage: katsubushi-py"), result.stderr


def test_help_for_an_unknown_command() -> None:
    result = run("help", "frobnicate")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"katsubushi-py: error: no command 'frobnicate'; commands: {', '.join(COMMANDS)}")


def test_unknown_command_is_named() -> None:
    result = run("frobnicate")
    assert result.returncode == 2
    assert result.stderr.startswith("katsubushi-py: error: unknown command 'frobnicate'")


# -- id-at -----------------------------------------------------------------------------------------
def test_id_at_now_is_the_current_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    result = run("id-at", "now")
    after = time.time_ns() // 1_000_000
    assert result.returncode == 0, result.stderr
    unix_ms, worker, sequence = decode(int(result.stdout))
    assert before <= unix_ms <= after and worker == 0 and sequence == 0


def test_id_at_now_honours_the_epoch() -> None:
    before = time.time_ns() // 1_000_000
    result = run("id-at", "--epoch", "2020-01-01T00:00:00Z", "NOW")
    after = time.time_ns() // 1_000_000
    epoch = 1_577_836_800_000
    assert before - epoch <= int(result.stdout) >> 22 <= after - epoch


@pytest.mark.parametrize(
    "when", ["2026-01-01T00:00:00Z", "2026-01-01T09:00:00+09:00", "2025-12-31T19:00:00-05:00", "2026-01-01"]
)
def test_id_at_iso_times_with_offsets_are_the_same_instant(when: str) -> None:
    result = run("id-at", when)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == (1_767_225_600_000 - KATSUBUSHI_EPOCH_MS) << 22


# -- missing directories ---------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--sock", "--state-file"])
def test_missing_parent_directory_says_which_to_create(option: str, tmp_path: Path) -> None:
    missing = tmp_path / "run" / "katsubushi"
    result = run("--worker-id", "1", "--port", str(free_port()), option, str(missing / "file"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"katsubushi-py: error: {option} {missing / 'file'}: directory {missing} does not exist;"
        f" create it (mkdir -p {missing}) and make it writable by the daemon's user"
    )


# -- health ----------------------------------------------------------------------------------------
def health(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run("health", *args, env=env)


def assert_healthy(result: subprocess.CompletedProcess[str], *where: str, worker: int = 7) -> None:
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    line = result.stdout.strip()
    assert len(result.stdout.splitlines()) == 1 and line.startswith("katsubushi-py health: ok: ")
    answers = line.removeprefix("katsubushi-py health: ok: ").split("; ")
    assert [a.split(" issued ")[0] for a in answers] == list(where)
    for answer in answers:
        id_ = int(answer.split(" issued ")[1].split()[0])
        assert decode(id_)[1] == worker and answer.endswith(f"(worker {worker})")


def assert_unhealthy(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 1, result.stdout
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("katsubushi-py health: unhealthy: "), result.stderr
    assert message in lines[0]


def test_health_with_the_daemons_port_flag(daemons: DaemonFactory) -> None:
    d = daemons.start()
    assert_healthy(health("--port", str(d.port)), f"127.0.0.1:{d.port}")


def test_health_with_the_daemons_environment(daemons: DaemonFactory) -> None:
    d = daemons.start()
    assert_healthy(health(env={"PORT": str(d.port)}), f"127.0.0.1:{d.port}")


def test_health_accepts_the_daemons_whole_command_line(daemons: DaemonFactory) -> None:
    """The same flags as the daemon, worker id and all, so one line can be pasted into a probe."""
    d = daemons.start("--host", "0.0.0.0", "--idle-timeout", "1m", "--max-connections", "100", worker_id=11)
    result = health("--worker-id", "11", "--host", "0.0.0.0", "--port", str(d.port), "--idle-timeout", "1m")
    assert_healthy(result, f"127.0.0.1:{d.port}", worker=11)


def test_health_on_a_unix_socket(daemons: DaemonFactory, short_tmp: Path) -> None:
    sock = str(short_tmp / "ids.sock")
    daemons.start(port=None, sock=sock)
    assert_healthy(health("--sock", sock), sock)
    assert_healthy(health(env={"SOCK": sock}), sock)


def test_health_checks_every_listener(daemons: DaemonFactory, short_tmp: Path) -> None:
    sock = str(short_tmp / "ids.sock")
    d = daemons.start(sock=sock)
    assert_healthy(health("--sock", sock, "--port", str(d.port)), sock, f"127.0.0.1:{d.port}")
    d.stop()
    assert_unhealthy(health("--sock", sock, "--port", str(d.port)), sock)


def test_health_of_a_daemon_that_is_not_there() -> None:
    port = free_port()
    assert_unhealthy(health("--port", str(port)), f"127.0.0.1:{port}: Connection refused")


def test_health_default_is_the_daemons_default(daemons: DaemonFactory) -> None:
    """With no flags the check asks 127.0.0.1:11212, where a daemon with no flags listens."""
    result = health()
    if result.returncode == 0:
        pytest.skip("something already answers on 127.0.0.1:11212")
    assert_unhealthy(result, "127.0.0.1:11212")


@pytest.fixture
def fake_server() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP server that answers every connection with the next canned reply, for the replies a
    healthy daemon never sends."""
    replies: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                conn.recv(100)
                reply = replies.pop(0) if replies else b""
                if reply == b"hang":
                    stop.wait(5)
                else:
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], replies
    finally:
        stop.set()
        thread.join()
        listener.close()


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (
            b"SERVER_ERROR clock moved backwards by 5000 ms\r\n",
            "answered 'SERVER_ERROR clock moved backwards by 5000 ms'",
        ),
        (b"SERVER_ERROR worker id lease not confirmed\r\n", "lease not confirmed"),
        (b"VALUE health 0 3\r\nabc\r\nEND\r\n", "answered 'VALUE health 0 3' instead of an ID"),
        (b"VALUE health 0 5\r\n12\r\nEND\r\n", "instead of an ID"),
        (b"", "the connection closed without an answer"),
        (b"hang", "no answer within 0.5 s"),
    ],
)
def test_health_reports_a_daemon_that_cannot_issue(
    fake_server: tuple[int, list[bytes]], reply: bytes, message: str
) -> None:
    port, replies = fake_server
    replies.append(reply)
    assert_unhealthy(health("--port", str(port), "--timeout", "0.5s"), message)


def test_health_from_the_daemons_process(daemons: DaemonFactory, short_tmp: Path) -> None:
    """--pid reads the daemon's flags and environment from /proc: here a port flag that wins over a
    PORT variable, and a unix socket given only in the environment. The checker's own environment
    says something else, and is not used."""
    sock = str(short_tmp / "ids.sock")
    port = free_port()
    d = daemons.start(port=port, env={"PORT": "1", "SOCK": sock})
    assert_healthy(health("--pid", str(d.pid), env={"PORT": "2"}), sock, f"127.0.0.1:{port}")


def test_health_pid_errors(daemons: DaemonFactory) -> None:
    assert_unhealthy(health("--pid", str(os.getpid())), f"process {os.getpid()} is not katsubushi-py")
    assert_unhealthy(health("--pid", "999999999"), "cannot read process 999999999")
    d = daemons.start()
    assert_unhealthy(health("--pid", str(d.pid), "--port", "1"), "--pid reads the daemon's flags from its process")


def test_health_arguments_from_a_process_command_line() -> None:
    from katsubushi_py.health import HealthError, daemon_arguments

    console = ["/usr/local/bin/python3.12", "/usr/local/bin/katsubushi-py", "--host", "0.0.0.0", "--port", "1"]
    assert daemon_arguments(console, 1) == ["--host", "0.0.0.0", "--port", "1"]
    init = ["/sbin/docker-init", "--", "katsubushi-py", "serve", "--sock", "/run/k.sock"]  # docker run --init
    assert daemon_arguments(init, 1) == ["--sock", "/run/k.sock"]
    assert daemon_arguments(["python3", "-m", "katsubushi_py", "-port", "5"], 1) == ["-port", "5"]
    with pytest.raises(HealthError, match="runs 'katsubushi-py decode', not the daemon"):
        daemon_arguments(["katsubushi-py", "decode", "1"], 1)


def test_health_bad_options_are_unhealthy_not_status_2() -> None:
    """Docker reserves exit status 2 for health checks: every failure is 1."""
    assert_unhealthy(health("--port", "banana"), "invalid port 'banana'")
    assert_unhealthy(health("--port", "0"), "port 0")


# -- usage errors and help a newcomer meets (issue 25) ---------------------------------------------
def test_help_with_an_action_shows_that_actions_help() -> None:
    """``help lease init`` is ``lease init --help``, not the help of ``lease``."""
    result = run("help", "lease", "init")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: katsubushi-py lease init")
    assert "--min" in result.stdout and "--max" in result.stdout
    assert result.stdout == run("lease", "init", "--help").stdout


def test_loop_help_lists_its_choices() -> None:
    text = " ".join(run("--help").stdout.split())
    # Python 3.13's argparse names the metavar once ("--loop, -loop LOOP"),
    # earlier versions after each option string.
    assert re.search(r"--loop(?: LOOP)?, -loop LOOP event loop: auto, uvloop or asyncio", text), text


@pytest.mark.parametrize("value", ["-1", "-1s", "-0.5"])
def test_a_negative_max_clock_wait_says_so(value: str) -> None:
    result = run("--worker-id", "1", f"--max-clock-wait={value}")
    assert result.returncode == 2
    assert result.stderr == (
        f"katsubushi-py: error: invalid --max-clock-wait {value!r}: must not be negative (0, seconds, or a Go"
        " duration such as 1s or 500ms)\n"
    )


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("999.1.1.1", "invalid --host '999.1.1.1': not an IP address"),
        ("1.2.3", "invalid --host '1.2.3': not an IP address"),
        ("10.0.0.1:11212", "invalid --host '10.0.0.1:11212': not an IP address (give the port with --port)"),
        ("::g", "invalid --host '::g': not an IP address"),
        ("my host", "invalid --host 'my host': not an IP address or a host name"),
        ("", "invalid --host '': give an address (0.0.0.0 or :: for every interface)"),
    ],
)
def test_a_host_that_is_not_an_address_is_a_usage_error(host: str, message: str) -> None:
    """Exit status 2 and one line, like every other usage error (it was a failed bind: status 1)."""
    result = run("--worker-id", "1", "--port", str(free_port()), "--host", host)
    assert (result.returncode, result.stderr) == (2, f"katsubushi-py: error: {message}\n")


def test_lease_list_into_a_closed_pipe_is_not_a_redis_error(redis_server: object) -> None:
    """``lease list | head -1``: the first row, exit status 0, nothing on stderr (it was a
    'Broken pipe' blamed on Redis, exit 1)."""
    url = f"{redis_server.url}?ns=pipe"  # type: ignore[attr-defined]
    env = {k: v for k, v in os.environ.items() if k.upper() != "REDIS"}
    assert run("lease", "init", "--redis", url, env=env).returncode == 0
    command = " ".join([*DAEMON_CMD, "lease", "list", "--redis", f"'{url}'"])
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{command} | head -1"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith('{"worker_id":1,') and len(result.stdout.splitlines()) == 1
