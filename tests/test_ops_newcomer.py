"""A newcomer's day without a stumble (issue 35), each on a real daemon: start-up lines that say what
happened (TLS listeners labelled ``https://`` and ``tls://``, a missing compiled module named as not
built, a waiting daemon naming the pool's own range), ``health --pid`` resolving the daemon's relative
paths from its working directory, and the docs' commands run as written, each with a timeout."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import DAEMON_CMD, DaemonFactory, daemon_env, free_port, wait_for_port, wait_for_unix
from lease_helpers import get, init_pool, start_leased, stats, wait_until
from redis_servers import RedisServer
from tls_certs import Certs, make_certs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    return make_certs(tmp_path_factory.mktemp("certs"))


# -- the start-up line -----------------------------------------------------------------------------
def test_tls_listeners_are_logged_as_tls_and_the_logged_https_address_answers(
    daemons: DaemonFactory, certs: Certs, short_tmp: Path
) -> None:
    """They were logged ``http://`` and ``grpc://`` (a curl to the logged address got an empty reply);
    the plain listeners beside them (--plain-port, the unix socket) keep no scheme."""
    http, grpc_port, plain = free_port(), free_port(), free_port()
    sock = str(short_tmp / "k.sock")
    d = daemons.start(
        "--tls-cert", certs.server.cert, "--tls-key", certs.server.key, "--http-port", str(http),
        "--grpc-port", str(grpc_port), "--plain-port", str(plain), "--sock", sock,
    )  # fmt: skip
    line = d.wait_for_log("serving worker id")
    where = re.search(r" on (.*) \(loop", line)
    assert where is not None, line
    assert where.group(1).split(", ") == [
        f"tls://127.0.0.1:{d.port}",
        f"127.0.0.1:{plain}",
        f"https://127.0.0.1:{http}",
        f"grpc+tls://127.0.0.1:{grpc_port}",
        sock,
    ]
    curl = shutil.which("curl")
    if curl is not None:  # what the newcomer did: curl the logged address
        out = subprocess.run(
            [curl, "-sS", "--cacert", certs.ca.cert, f"https://localhost:{http}/id"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0 and out.stdout.strip().isdigit(), out.stdout + out.stderr


def test_the_workers_supervisor_names_tls_listeners_as_tls(certs: Certs) -> None:
    """The --workers supervisor names the listeners it opens (in its start-up warnings) as the daemon
    does: here on loopback, its sockets opened and closed, no process started."""
    from katsubushi_py.config import parse_server_config
    from katsubushi_py.daemon.workers import Supervisor

    port, http, grpc_port = free_port(), free_port(), free_port()
    argv = ["--worker-id", "1", "--workers", "2", "--port", str(port), "--http-port", str(http)]
    argv += ["--grpc-port", str(grpc_port), "--tls-cert", certs.server.cert, "--tls-key", certs.server.key]
    config, _ = parse_server_config(argv, {})
    assert config is not None
    supervisor = Supervisor(config, lambda *_: 0)
    supervisor.open_listeners()
    try:
        assert supervisor.addresses() == [
            f"tls://127.0.0.1:{port}",
            f"https://127.0.0.1:{http}",
            f"grpc+tls://127.0.0.1:{grpc_port}",
        ]
    finally:
        supervisor.close_listeners()


def package_without_compiled_modules(tmp_path: Path) -> Path:
    """The package as pip installs it where no C compiler is found: the sources, no ``*.so``."""
    copy = tmp_path / "site"
    shutil.copytree(
        ROOT / "katsubushi_py", copy / "katsubushi_py", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    return copy


def test_without_the_compiled_module_the_warning_says_it_was_not_built(tmp_path: Path) -> None:
    """The warning blamed "a circular import" (what Python says of a submodule missing inside its
    package's own import). The daemon runs with ``python -S``, so that the editable install's path hook
    (which would find the compiled module of the checkout) is not there: only the copy and the
    dependencies in site-packages."""
    site = package_without_compiled_modules(tmp_path)
    port = free_port()
    paths = [str(site), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    code = (
        f"import sys, runpy; sys.path[:0] = {paths!r}; "
        f"sys.argv = ['katsubushi-py', '--worker-id', '3', '--port', '{port}']; "
        "runpy.run_module('katsubushi_py', run_name='__main__')"
    )
    env = {
        k: v for k, v in daemon_env(tmp_path / "state").items() if k not in ("PYTHONPATH", "KATSUBUSHI_NO_EXTENSIONS")
    }
    log = tmp_path / "daemon.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.DEVNULL, stderr=err, env=env)
    try:
        wait_for_port(port, proc)
        wait_until(lambda: "WARNING" in log.read_text(), timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    [warning] = [line for line in log.read_text().splitlines() if "WARNING" in line]
    assert "circular import" not in warning, warning
    assert "running the pure-Python hot path (not built: the compiled module katsubushi_py._speedups is not" in warning
    assert "only where a C compiler and the Python headers are found" in warning
    assert warning.endswith("reinstall where a C compiler and the Python headers exist (gcc, python3-dev) to build it")


@pytest.mark.once
def test_a_daemon_waiting_in_a_smaller_pool_names_the_pools_range(
    daemons: DaemonFactory, redis_server: RedisServer
) -> None:
    """A pool made 1..1 (``lease init``), daemons left at the default 1..1023: the second one waits, and
    said "no free worker id in 1..1023", naming 1022 ids that do not exist."""
    init_pool(redis_server.url, "t", 1, 1)
    holder = start_leased(daemons, redis_server.url, init=False)
    assert stats(holder)["worker_id"] == "1"
    waiting = start_leased(daemons, redis_server.url, init=False, wait=False)
    wait_for_port(waiting.port, waiting.proc)  # type: ignore[arg-type]
    wait_until(lambda: stats(waiting)["lease_state"] == "waiting", timeout=10)
    message = "no free worker id in 1..1 (the pool in Redis holds 1..1; --min-worker-id..--max-worker-id 1..1023)"
    assert get(waiting) == f"SERVER_ERROR waiting for a worker id lease: {message}\r\n".encode()
    assert message in waiting.stderr()
    assert "1..1023:" not in waiting.stderr() and "in 1..1023" not in waiting.stderr()


# -- health --pid ----------------------------------------------------------------------------------
def test_health_pid_resolves_relative_paths_from_the_daemons_directory(tmp_path: Path, short_tmp: Path) -> None:
    """A daemon started in its own directory with ``--sock k.sock --auth-file users`` (relative) is
    checked from another directory: the paths are the daemon's, not the checker's."""
    (short_tmp / "users").write_text("app:secret-password\n")
    port = free_port()
    log = tmp_path / "daemon.log"
    argv = [*DAEMON_CMD, "--worker-id", "4", "--port", str(port), "--sock", "k.sock", "--auth-file", "users"]
    env = daemon_env(tmp_path / "state")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=err, env=env, cwd=short_tmp)
    try:
        wait_for_unix(str(short_tmp / "k.sock"), proc)
        check = subprocess.run(
            [*DAEMON_CMD, "health", "--pid", str(proc.pid)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
            env={**env, "SOCK": "", "AUTH_FILE": ""},
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert f"{short_tmp / 'k.sock'} issued" in check.stdout and f"127.0.0.1:{port} issued" in check.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_health_pid_says_why_when_the_daemons_directory_cannot_be_read() -> None:
    from katsubushi_py.health import HealthError, resolve_from_daemon

    assert resolve_from_daemon({"sock": "/abs.sock", "auth_file": None}, 999_999_999) == {
        "sock": "/abs.sock",
        "auth_file": None,
    }
    assert resolve_from_daemon({"sock": "@abstract"}, 999_999_999) == {"sock": "@abstract"}
    with pytest.raises(HealthError, match="working directory of process 999999999, from which its relative --sock"):
        resolve_from_daemon({"sock": "k.sock"}, 999_999_999)
    mine = resolve_from_daemon({"sock": "k.sock", "auth_file": "users"}, os.getpid())
    assert mine == {"sock": os.path.join(os.getcwd(), "k.sock"), "auth_file": os.path.join(os.getcwd(), "users")}


# -- the docs' commands, run as written ------------------------------------------------------------
def marked_block(path: Path, marker: str) -> list[str]:
    """The lines of the ``sh`` block after ``<!-- marker: ... -->`` in ``path``, continuations joined."""
    text = path.read_text()
    after = text[text.index(f"<!-- {marker}:") :]
    block = after[after.index("```sh\n") + 6 :]
    return re.sub(r"\\\n\s*", " ", block[: block.index("```")]).splitlines()


def as_run_here(line: str, port: int, http: int) -> str:
    """A documented line on this test's free ports, on loopback, with the daemon of this checkout;
    the daemon started in the background records its pid (the test stops it)."""
    line = line.replace("11212", str(port)).replace("8080", str(http)).replace("--host 0.0.0.0", "--host 127.0.0.1")
    if line.startswith("katsubushi-py "):
        line = f"{sys.executable} -m katsubushi_py --port {port} " + line.removeprefix("katsubushi-py ")
        assert line.endswith(" &"), "the doc starts its daemon in the background"
        line = line.removesuffix(" &") + " > daemon.log 2>&1 & echo $! > daemon.pid"  # not holding our pipes
    return line


def run_documented(lines: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The lines in one bash (``set -e``), in ``tmp_path``, within 60 s; the daemon they start stopped."""
    port, http = free_port(), free_port()
    script = "set -e\n" + "\n".join(as_run_here(line, port, http) for line in lines) + "\n"
    env = daemon_env(tmp_path / "state")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    try:
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    finally:
        pid_file = tmp_path / "daemon.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid), timeout=10)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return "zombie"


@pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("curl") is None, reason="needs openssl and curl")
def test_the_test_certificate_recipe_serves_tls_and_its_checks_return(tmp_path: Path) -> None:
    """docs/operations.md's recipe: a CA and a server certificate made by openssl, the daemon on them,
    curl and ``openssl s_client`` checks; the s_client check hung until the idle timeout (10 min)."""
    out = run_documented(marked_block(ROOT / "docs" / "operations.md", "test-certificate"), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # curl's /id (no newline after it), then the memcached reply over TLS
    assert re.fullmatch(r"\d+VALUE a 0 \d+\r?\n\d+\r?\nEND\r?\n", out.stdout), out.stdout


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_every_documented_s_client_check_returns(daemons: DaemonFactory, certs: Certs) -> None:
    """Each ``openssl s_client`` line of the README and docs, on a TLS daemon (its host and CA
    substituted), ends by itself within 20 s."""
    d = daemons.start("--tls-cert", certs.server.cert, "--tls-key", certs.server.key)
    found = [
        (path.name, line.strip())
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for line in path.read_text().splitlines()
        if "| openssl s_client" in line
    ]
    assert found
    for name, line in found:
        command = re.sub(r"-connect \S+", f"-connect localhost:{d.port}", line)
        command = re.sub(r"-CAfile \S+", f"-CAfile {certs.ca.cert}", command)
        try:
            out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: {line!r} did not return within 20 s")
        assert "VALUE a 0 " in out.stdout, (name, line, out.stdout, out.stderr)


@pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("curl") is None, reason="needs openssl and curl")
def test_the_readmes_auth_example_runs_with_what_the_quick_start_installs(tmp_path: Path) -> None:
    """It needed bmemcached (python-binary-memcached), which ``pip install .`` does not bring: the
    example's Python line uses only the package's own dependencies (checked against pyproject.toml)."""
    lines = marked_block(ROOT / "README.md", "auth-example")
    imported = {
        a or b
        for line in lines
        if line.startswith("python3")
        for a, b in re.findall(r"\bfrom (\w+)\S* import|\bimport (\w+)", line)
    }
    dependencies = (ROOT / "pyproject.toml").read_text().split("dependencies = [", 1)[1].split("]", 1)[0]
    assert imported - {"sys", "secrets"} <= {"pymemcache"} and '"pymemcache' in dependencies, imported
    out = run_documented(lines, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.fullmatch(r"\d+b'\d+'\n", out.stdout), out.stdout  # curl's ID (no newline), then pymemcache's


def test_the_readmes_python_example_does_not_reuse_the_daemons_worker_id() -> None:
    """The quick start's daemon has worker id 1; the Python example used 1 as well, and the two issue
    the same IDs when both run."""
    readme = (ROOT / "README.md").read_text()
    daemon = re.search(r"pip install \. && katsubushi-py --worker-id (\d+)", readme)
    python = re.search(r"Generator\(worker_id=(\d+)\)", readme)
    assert daemon is not None and python is not None
    assert daemon.group(1) != python.group(1)


def test_the_image_tag_built_is_the_one_the_kubernetes_manifests_run() -> None:
    """The README built ``katsubushi-py`` (``latest``) while the manifests run ``katsubushi-py:1.0.0``."""
    import katsubushi_py

    tag = f"katsubushi-py:{katsubushi_py.__version__}"
    images = {
        image
        for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
        for image in re.findall(r"^\s*image:\s*(\S+)", path.read_text(), re.MULTILINE)
    }
    assert images == {tag}, images
    builds = [
        (path.name, line)
        for path in [ROOT / "README.md", ROOT / "Dockerfile", *sorted((ROOT / "docs").glob("*.md"))]
        for line in path.read_text().splitlines()
        if "docker build" in line
    ]
    assert builds
    for name, line in builds:
        assert f"-t {tag} " in line or f"-t REGISTRY/{tag} " in line, (name, line)


def test_the_default_redis_namespace_is_documented() -> None:
    from katsubushi_py.leasing import parse_redis_url
    from katsubushi_py.leasing.target import DEFAULT_NAMESPACE

    assert parse_redis_url("redis://127.0.0.1:6379/0").namespace == DEFAULT_NAMESPACE == "katsubushi"
    leasing = " ".join((ROOT / "docs" / "leasing.md").read_text().split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Without `ns` the namespace is `{DEFAULT_NAMESPACE}`" in leasing
    assert f"without it the namespace is `{DEFAULT_NAMESPACE}`" in readme
