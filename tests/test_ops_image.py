"""The container image runs the compiled hot path (issue 25).

No container engine runs here and no base image can be pulled, so this test does what the
Dockerfile's build stage does: it copies exactly the paths that stage's ``COPY`` lines copy (parsed
from the Dockerfile, minus what ``.dockerignore`` keeps out of the build context) into an empty
directory, runs that stage's ``RUN`` lines there, and checks that the wheel holds the compiled
extension. Then the final stage's own check (the ``python -c`` that fails the image build unless the
installed package reports ``IMPLEMENTATION == "compiled"``) is run against that wheel, unpacked: it
passes, and it fails when the extension is missing or disabled.

About 15 s (pip makes a build environment with setuptools from the package index, and compiles).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, word: str) -> list[str]:
        return [rest for w, rest in self.instructions if w == word]


def stages() -> list[Stage]:
    """Every stage of the Dockerfile: continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    found: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":
            base, _, name = rest.partition(" AS ") if " AS " in rest else rest.partition(" as ")
            found.append(Stage(base.strip(), name.strip()))
        else:
            found[-1].instructions.append((word, rest))
    return found


def build_stage() -> Stage:
    named = [s for s in stages() if s.name == "build"]
    assert len(named) == 1, "the Dockerfile needs one stage named build"
    return named[0]


def dockerignore() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def ignored(relative: str, patterns: list[str]) -> bool:
    """.dockerignore's matching, for the patterns used there: a leading ``**/`` matches at any depth,
    and a pattern that matches a directory excludes everything under it."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("**/"):
            tail = pattern[3:]
            if any(fnmatch.fnmatchcase(part, tail) for part in parts):
                return True
        elif any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            return True
    return False


def copy_like_docker(sources: list[str], dest: Path, patterns: list[str]) -> None:
    """``COPY src... dest``: a file goes into dest (a directory when it ends with / or there are
    several sources), a directory's contents go into dest."""
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: not in the repository"
        if path.is_dir():
            for item in sorted(path.rglob("*")):
                relative = str(item.relative_to(ROOT))
                if item.is_file() and not ignored(relative, patterns):
                    target = dest / item.relative_to(path)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(item, target)
        elif not ignored(source, patterns):
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / path.name)


@dataclass
class Built:
    context: Path  # what the build stage's COPY lines put in its WORKDIR
    wheel: Path


def container_path(root: Path, path: str, workdir: str) -> Path:
    """Where a path of the build container lives in this test: absolute ones under ``root``."""
    absolute = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    return root / absolute.lstrip("/")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    stage = build_stage()
    root = tmp_path_factory.mktemp("build-stage")
    [workdir] = stage.all("WORKDIR")
    patterns = dockerignore()
    for arguments in stage.all("COPY"):
        words = shlex.split(arguments)
        assert not any(w.startswith("--") for w in words), f"COPY {arguments}: flags are not reproduced here"
        copy_like_docker(words[:-1], container_path(root, words[-1], workdir), patterns)
    context = container_path(root, ".", workdir)
    # Nothing compiled came along: whatever the wheel holds, this build made.
    assert not [p for p in context.rglob("*") if p.suffix in (".so", ".pyc")]

    env = {k: v for k, v in os.environ.items() if k != "KATSUBUSHI_NO_EXTENSIONS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's pip
    for command in stage.all("RUN"):
        # Absolute paths of the container (/wheels) live under root here.
        local = re.sub(r"(?<=\s)/[\w./-]+", lambda m: str(container_path(root, m.group(0), workdir)), command)
        result = subprocess.run(["sh", "-c", local], cwd=context, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, f"RUN {command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"

    # The final stage copies the build stage's wheel directory: the one wheel there is what it installs.
    final = stages()[-1]
    [copied] = [shlex.split(c) for c in final.all("COPY") if c.startswith("--from=build")]
    wheels = sorted(container_path(root, copied[1], workdir).glob("katsubushi_py-*.whl"))
    assert len(wheels) == 1, wheels
    return Built(context, wheels[0])


@pytest.mark.once
def test_the_build_stage_wheel_holds_the_compiled_extension(built: Built) -> None:
    names = zipfile.ZipFile(built.wheel).namelist()
    for module in ("_speedups", "_grpc_speedups"):
        extension = f"katsubushi_py/{module}{sysconfig.get_config_var('EXT_SUFFIX')}"
        assert extension in names, sorted(n for n in names if "_speedups" in n)
        assert f"katsubushi_py/{module}.c" not in names
    assert re.fullmatch(r"katsubushi_py-[\d.]+-cp\d+-cp\d+-linux_\w+\.whl", built.wheel.name), built.wheel.name


def image_check() -> str:
    """The final stage's ``python -c`` that fails the build without the compiled hot path."""
    final = stages()[-1]
    [run] = final.all("RUN")
    checks = [shlex.split(part) for part in run.split("&&") if part.strip().startswith("python -c")]
    assert len(checks) == 1, run
    code = checks[0][2]
    assert 'IMPLEMENTATION == "compiled"' in code
    return code


@pytest.fixture(scope="module")
def unpacked(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel's files: what pip install puts in the image's site-packages (our code needs no
    third-party package to import ``katsubushi_py.compiled``)."""
    where = tmp_path_factory.mktemp("site")
    zipfile.ZipFile(built.wheel).extractall(where)
    return where


def run_check(site: Path, disabled: str = "0") -> subprocess.CompletedProcess[str]:
    """The check, with the unpacked wheel as the only place the package can come from: ``-S`` keeps
    this environment's site-packages (and its editable install's import hook) out."""
    env = {**os.environ, "PYTHONPATH": str(site), "KATSUBUSHI_NO_EXTENSIONS": disabled}
    where = subprocess.run(
        [sys.executable, "-S", "-c", "import katsubushi_py._speedups as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=site,
        timeout=30,
    )
    assert where.stdout.startswith(str(site)) or "No module named" in where.stderr, where.stderr
    return subprocess.run(
        [sys.executable, "-S", "-c", image_check()], capture_output=True, text=True, env=env, cwd=site, timeout=30
    )


@pytest.mark.once
def test_the_images_check_passes_with_the_built_wheel(unpacked: Path) -> None:
    result = run_check(unpacked)
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.once
def test_the_images_check_fails_the_build_without_the_compiled_path(unpacked: Path, tmp_path: Path) -> None:
    disabled = run_check(unpacked, disabled="1")
    assert disabled.returncode == 1
    assert disabled.stderr == "katsubushi-py: no compiled hot path in the image: KATSUBUSHI_NO_EXTENSIONS is set\n"
    without = tmp_path / "site"
    shutil.copytree(unpacked, without)
    for module in without.glob("katsubushi_py/_speedups*.so"):
        module.unlink()
    missing = run_check(without)
    assert missing.returncode == 1
    assert missing.stderr.startswith(
        "katsubushi-py: no compiled hot path in the image: not built: the compiled module katsubushi_py._speedups"
        " is not installed"
    )
    no_grpc = tmp_path / "site-without-grpc"
    shutil.copytree(unpacked, no_grpc)
    for module in no_grpc.glob("katsubushi_py/_grpc_speedups*.so"):
        module.unlink()
    missing_grpc = run_check(no_grpc)
    assert missing_grpc.returncode == 1
    assert missing_grpc.stderr == (
        "katsubushi-py: no compiled hot path in the image: the gRPC fast path (_grpc_speedups) was not built\n"
    )


def test_the_dockerignore_keeps_compiled_files_out_of_the_copied_tree() -> None:
    """A module compiled in place (pip install -e) is for the host's Python, not the image's."""
    patterns = dockerignore()
    assert ignored("katsubushi_py/_speedups.cpython-311-x86_64-linux-gnu.so", patterns)
    assert ignored("katsubushi_py/daemon/__pycache__/server.cpython-312.pyc", patterns)
    assert not ignored("katsubushi_py/_speedups.c", patterns) and not ignored("setup.py", patterns)


def test_the_build_stage_has_a_compiler_and_copies_what_setup_py_needs() -> None:
    stage = build_stage()
    copied = [word for arguments in stage.all("COPY") for word in shlex.split(arguments)[:-1]]
    assert {"setup.py", "pyproject.toml", "katsubushi_py"} <= set(copied)
    assert "-slim" not in stage.base, "the slim image has no C compiler"
    final = stages()[-1]
    assert "-slim" in final.base and final.base.split(":")[1].split("-")[0] == stage.base.split(":")[1].split("-")[0]
    assert json.loads(final.all("ENTRYPOINT")[0])[0] == "katsubushi-py"
