"""Compile the router's hot path with mypyc (`make router`; `make run` and `make test` run it first).

    .venv/bin/python scripts/build_router.py [--force]

Builds `serving.router.native.MODULES` into `var/router-native/<digest>/` (the digest of their
sources: see `serving/router/native.py`, which loads the build only while it matches them) and
removes older builds. Does nothing when the build of the current sources is there. It compiles
a copy of the sources, named by the copy's digest, so an edit saved mid-build cannot end up
under the wrong name; builds take a lock, so `make run` and `make test` side by side build
once. When the build cannot be made (no C compiler or Python headers, mypyc missing, a
read-only checkout, a type error mypyc rejects) it says why and exits 0: the router then runs
as Python, deciding the same, about half as fast.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving.router import native  # noqa: E402  # after the path, as every script here

# mypyc checks the modules as it compiles them: strict, and alone (the project's own mypy
# configuration loads Django's plugin, which needs settings that the router never imports).
MYPY_CONFIG = "[mypy]\nstrict = True\nwarn_unused_ignores = False\n"


class CannotBuild(Exception):
    """Why the router stays Python on this machine."""


def build(force: bool = False) -> Path | None:
    """The build of the current sources, made if missing; None when it cannot be made."""
    try:
        with _locked():
            return _build(force)
    except CannotBuild as reason:
        print(f"router: {reason}; the router runs as Python")
        return None


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    try:
        native.BUILDS_DIR.mkdir(parents=True, exist_ok=True)
        lock = (native.BUILDS_DIR / ".lock").open("a")
    except OSError as error:
        raise CannotBuild(f"cannot write {native.BUILDS_DIR} ({error})") from error
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build of the same sources: wait, reuse it
        yield


def _build(force: bool) -> Path:
    target = native.build_dir()
    if native.is_complete(target) and not force:
        print(f"router: compiled build up to date ({target.relative_to(ROOT)})")
        return target
    compiler = shlex.split(os.environ.get("CC", "cc"))[:1]
    if not compiler or shutil.which(compiler[0]) is None:
        raise CannotBuild("no C compiler (cc)")
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution
    except ImportError as error:
        raise CannotBuild(f"cannot compile ({error})") from error
    for unfinished in native.BUILDS_DIR.glob(".building-*"):  # left by a killed build
        shutil.rmtree(unfinished, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=native.BUILDS_DIR, prefix=".building-") as work:
        work_dir = Path(work)
        package = _copy_sources(work_dir / "src")
        digest = native.source_digest(package)
        output = io.StringIO()
        try:
            with contextlib.chdir(work_dir / "src"), contextlib.redirect_stdout(output):
                (work_dir / "mypy.ini").write_text(MYPY_CONFIG)
                extensions = mypycify(
                    [
                        "--config-file",
                        str(work_dir / "mypy.ini"),
                        "--cache-dir",
                        str(work_dir / "mypy-cache"),
                        *(f"serving/router/{module}.py" for module in native.MODULES),
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
            raise CannotBuild(f"compiling failed ({error!r})") from error
        built = work_dir / "out"
        (built / "serving" / "router" / native.COMPLETE).write_text(digest + "\n")
        made = native.BUILDS_DIR / digest
        if made.exists():  # only with --force: nothing loads a build while it is replaced
            shutil.rmtree(made)
        built.rename(made)
    for older in native.BUILDS_DIR.iterdir():
        if older != made and not older.name.startswith("."):
            shutil.rmtree(older, ignore_errors=True)
    print(f"router: compiled {', '.join(native.MODULES)} into {made.relative_to(ROOT)}")
    if made != target:
        print("router: the sources changed while compiling; run it again to build them")
    return made


def _copy_sources(root: Path) -> Path:
    """The compiled modules, copied under `root` as the package they are (they import only one
    another: tests/serving/test_router_native.py checks it), so what is compiled is what is
    named."""
    package = root / "serving" / "router"
    package.mkdir(parents=True)
    (root / "serving" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for module in native.MODULES:
        shutil.copyfile(native.PACKAGE_DIR / f"{module}.py", package / f"{module}.py")
    return package


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--force", action="store_true", help="build again even when up to date")
    build(parser.parse_args().force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
