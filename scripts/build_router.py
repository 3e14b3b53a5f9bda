"""Compile the router's hot path with mypyc (`make router`; `make run` and `make test` run it first).

    .venv/bin/python scripts/build_router.py [--force]

Builds `serving.router.native.MODULES` into `var/router-native/<digest>/` (the digest of their
sources: see `serving/router/native.py`, which loads the build only while it matches them) and
removes older builds. Does nothing when the build of the current sources is there. When the
build cannot be made (no C compiler, mypyc missing, a type error mypyc rejects) it says why and
exits 0: the router then runs as Python, deciding the same, about half as fast.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving.router import native  # noqa: E402  # after the path, as every script here

# mypyc checks the modules as it compiles them: strict, and alone (the project's own mypy
# configuration loads Django's plugin, which needs settings that the router never imports).
MYPY_CONFIG = "[mypy]\nstrict = True\nwarn_unused_ignores = False\n"


def build(force: bool = False) -> Path | None:
    """The build of the current sources, made if missing; None when it cannot be made."""
    target = native.build_dir()
    if (target / "serving" / "router" / ".complete").exists() and not force:
        print(f"router: compiled build up to date ({target.relative_to(ROOT)})")
        return target
    if shutil.which(os.environ.get("CC", "cc")) is None:
        print("router: no C compiler (cc); the router runs as Python")
        return None
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution
    except ImportError as error:
        print(f"router: cannot compile ({error}); the router runs as Python")
        return None
    native.BUILDS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=native.BUILDS_DIR, prefix=".building-") as work:
        work_dir = Path(work)
        config = work_dir / "mypy.ini"
        config.write_text(MYPY_CONFIG)
        sources = [f"serving/router/{module}.py" for module in native.MODULES]
        output = io.StringIO()
        try:
            with contextlib.chdir(ROOT), contextlib.redirect_stdout(output):
                extensions = mypycify(
                    [
                        "--config-file",
                        str(config),
                        "--cache-dir",
                        str(work_dir / "mypy-cache"),
                        *sources,
                    ],
                    opt_level="3",
                    group_name=native.GROUP,
                    target_dir=str(work_dir / "c"),
                )
                distribution = Distribution(
                    {"name": "serving-router-native", "ext_modules": extensions}
                )
                distribution.script_args = [
                    "build_ext",
                    "--build-lib",
                    str(work_dir / "out"),
                    "--build-temp",
                    str(work_dir / "temp"),
                ]
                distribution.parse_command_line()
                distribution.run_commands()
        except (SystemExit, Exception) as error:  # mypyc exits on a type error it rejects
            print(output.getvalue()[-4000:])
            print(f"router: compiling failed ({error!r}); the router runs as Python")
            return None
        built = work_dir / "out"
        (built / "serving" / "router" / ".complete").write_text(native.source_digest() + "\n")
        if target.exists():
            shutil.rmtree(target)
        built.rename(target)
    for older in native.BUILDS_DIR.iterdir():
        if older != target and not older.name.startswith("."):
            shutil.rmtree(older, ignore_errors=True)
    print(f"router: compiled {', '.join(native.MODULES)} into {target.relative_to(ROOT)}")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--force", action="store_true", help="build again even when up to date")
    build(parser.parse_args().force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
