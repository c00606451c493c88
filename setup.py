"""Builds the optional compiled hot path, ``katsubushi_py._speedups`` and ``_grpc_speedups`` (everything else is in
pyproject.toml). Where no C compiler works, or with ``KATSUBUSHI_NO_EXTENSIONS=1`` set at build time,
the extension is skipped with a warning and the pure-Python twin runs: the package still installs."""

import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all (DistutilsPlatformError and friends)
            self.warn(f"katsubushi_py._speedups not built ({exc}); the pure-Python hot path will run")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError, LinkError, missing headers
            self.warn(f"{ext.name} not built ({exc}); the pure-Python hot path will run")


skip = os.environ.get("KATSUBUSHI_NO_EXTENSIONS", "") not in ("", "0")
extensions = (
    []
    if skip
    else [
        # One translation unit: _speedups.c includes its parts (the types, one file each).
        Extension(
            "katsubushi_py._speedups",
            ["katsubushi_py/_speedups.c"],
            depends=[str(path) for path in sorted(Path("katsubushi_py").glob("*.h"))],
        ),
        # The gRPC fast path (frontends/grpc_h2.py), a module of its own; each may fail alone.
        Extension("katsubushi_py._grpc_speedups", ["katsubushi_py/_grpc_speedups.c"]),
    ]
)

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
