"""The package as a user gets it: ``python -m build`` makes an sdist and a wheel; the wheel, installed
into a fresh virtual environment with its dependencies from the package index, gives a working
``katsubushi-py`` (its version, a daemon that issues an ID over a real socket, its health check).

The build works on a copy of the checkout, so that the test never writes into the source tree.
About 30 s: most of it is pip making build environments and installing uvloop and redis.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import decode, free_port, parse_values, recv_until, wait_for_port

import katsubushi_py

ROOT = Path(__file__).resolve().parent.parent
IGNORED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "*.sock"
)


@dataclass
class Built:
    sdist: Path
    wheel: Path


def the_wheel(out: Path) -> Path:
    """The one wheel in ``out``: platform-specific, because it may carry the compiled hot path."""
    wheels = list(out.glob(f"katsubushi_py-{katsubushi_py.__version__}-cp*-*.whl"))
    assert len(wheels) == 1, sorted(p.name for p in out.iterdir())
    return wheels[0]


def build_env() -> dict[str, str]:
    """The environment a build gets: without KATSUBUSHI_NO_EXTENSIONS, which the pure-Python pass of
    the suite sets and which would also leave the extension out of the wheel."""
    return {k: v for k, v in os.environ.items() if k != "KATSUBUSHI_NO_EXTENSIONS"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    pytest.importorskip("build", reason="the test extra installs build")
    work = tmp_path_factory.mktemp("build")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=IGNORED)
    out = work / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        env=build_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    version = katsubushi_py.__version__
    sdist = out / f"katsubushi_py-{version}.tar.gz"
    wheel = the_wheel(out)
    assert sorted(p.name for p in out.iterdir()) == sorted([sdist.name, wheel.name])
    return Built(sdist, wheel)


def subpackages() -> list[str]:
    """Every package directory of the source tree, found independently of setuptools."""
    return sorted(str(init.parent.relative_to(ROOT)) for init in (ROOT / "katsubushi_py").rglob("__init__.py"))


def test_wheel_contains_every_subpackage_and_module(built: Built) -> None:
    names = set(zipfile.ZipFile(built.wheel).namelist())
    packages = subpackages()
    for layer in ("ids", "issuing", "leasing", "frontends", "daemon"):
        assert f"katsubushi_py/{layer}" in packages
    for package in packages:
        assert f"{package}/__init__.py" in names, package
    # Every file of the package: modules, py.typed, the gRPC service's .proto.
    files = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "katsubushi_py").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith((".pyc", ".so", ".c", ".h"))
    }
    assert {"katsubushi_py/py.typed", "katsubushi_py/cli.py"} <= files
    assert files <= names, sorted(files - names)
    # Built where a C compiler exists (here): the compiled hot path is in the wheel, its source is not.
    assert any(name.startswith("katsubushi_py/_speedups.") and name.endswith(".so") for name in names)
    assert "katsubushi_py/_speedups.c" not in names
    assert any(name.startswith("katsubushi_py/_grpc_speedups.") and name.endswith(".so") for name in names)
    assert "katsubushi_py/_grpc_speedups.c" not in names
    assert not any(name.endswith(".h") for name in names)  # (the parts of _speedups.c)
    assert not any(name.startswith(("tests/", "bench/")) for name in names)
    dist_info = f"katsubushi_py-{katsubushi_py.__version__}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    entry_points = zipfile.ZipFile(built.wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "katsubushi-py = katsubushi_py.entry:main" in entry_points
    metadata = zipfile.ZipFile(built.wheel).read(f"{dist_info}/METADATA").decode()
    assert f"Version: {katsubushi_py.__version__}\n" in metadata
    assert "Requires-Python: >=3.11" in metadata and "License-Expression: MIT" in metadata


def test_sdist_contains_the_docs_tests_and_deployment_files(built: Built) -> None:
    top = f"katsubushi_py-{katsubushi_py.__version__}"
    with tarfile.open(built.sdist) as tar:
        names = {name.removeprefix(f"{top}/") for name in tar.getnames()}
    for required in (
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "CHANGELOG.md",
        "Dockerfile",
        "contrib/katsubushi-py.service",
        "contrib/katsubushi-py.socket",
        "tests/conftest.py",
        "katsubushi_py/__init__.py",
        "katsubushi_py/_speedups.c",
        "katsubushi_py/_speedups_socket.h",
        "katsubushi_py/_tls_direct.h",
        "katsubushi_py/_grpc_speedups.c",
        "tests/grpc_js/package-lock.json",
        "tests/grpc_js/client.js",
        "setup.py",
        "bench/loadgen.c",
    ):
        assert required in names, required
    tracked_tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}
    assert tracked_tests <= names
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)


def test_version_is_defined_once() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "katsubushi_py.__version__" }' in pyproject
    assert "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]
    definitions = [p for p in (ROOT / "katsubushi_py").rglob("*.py") if "\n__version__ = " in p.read_text()]
    assert definitions == [ROOT / "katsubushi_py" / "__init__.py"]
    assert f"\n## {katsubushi_py.__version__}" in (ROOT / "CHANGELOG.md").read_text()


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment with the wheel and its dependencies installed; its bin directory."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # This interpreter's pip installs into the new environment (pip --python), which saves
    # bootstrapping a second pip; the wheel's dependencies come from the package index.
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", str(built.wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    yield venv / "bin"


def clean_env() -> dict[str, str]:
    """No PYTHONPATH or project variables: the installed package must stand on its own."""
    env = {k: v for k, v in os.environ.items() if k.upper() not in {"WORKER_ID", "PORT", "SOCK", "PYTHONPATH"}}
    env.pop("VIRTUAL_ENV", None)
    return env


def test_installed_wheel_reports_its_version(installed: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(installed / "katsubushi-py"), "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"katsubushi-py version: {katsubushi_py.__version__}\n"
    where = subprocess.run(
        [str(installed / "python"), "-c", "import katsubushi_py; print(katsubushi_py.__file__)"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert where.stdout.startswith(str(installed.parent)), "imported from the new environment, not the checkout"


def test_installed_wheel_serves_ids(installed: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [str(installed / "katsubushi-py"), "--worker-id", "21", "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=clean_env(),
    )
    try:
        wait_for_port(port, proc)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET a b\r\nVERSION\r\n")
            reply = recv_until(s, b"\r\n" + f"VERSION {katsubushi_py.__version__}\r\n".encode())
        ids = [id_ for _, id_ in parse_values(reply.split(b"VERSION ")[0])]
        assert len(ids) == 2 and ids[0] < ids[1] and {decode(i)[1] for i in ids} == {21}
        health = subprocess.run(
            [str(installed / "katsubushi-py"), "health", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
            env=clean_env(),
        )
        assert health.returncode == 0 and "(worker 21)" in health.stdout, health.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None and "uvloop" in proc.stderr.read().decode(), "uvloop came with the wheel"


def test_installed_wheel_runs_the_compiled_hot_path(installed: Path, tmp_path: Path) -> None:
    check = "import katsubushi_py.compiled as c; print(c.IMPLEMENTATION)"
    for extensions, expected in (("0", "compiled"), ("1", "python")):
        result = subprocess.run(
            [str(installed / "python"), "-c", check],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
            env={**clean_env(), "KATSUBUSHI_NO_EXTENSIONS": extensions},
        )
        assert result.stdout.strip() == expected, result.stderr


def test_without_a_c_compiler_the_sdist_still_builds_a_working_wheel(built: Built, tmp_path: Path) -> None:
    """Where no compiler works, the build warns and the wheel carries the pure-Python hot path only."""
    out = tmp_path / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(built.sdist)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**build_env(), "CC": "/bin/false"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    names = zipfile.ZipFile(the_wheel(out)).namelist()
    assert "katsubushi_py/issuing/generator.py" in names
    assert not any(name.startswith(("katsubushi_py/_speedups.", "katsubushi_py/_grpc_speedups.")) for name in names)
