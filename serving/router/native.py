"""The router's hot path compiled with mypyc, used when a build of these very sources exists.

`scripts/build_router.py` compiles `MODULES` into `var/router-native/<digest>/`, the digest
taken over their sources and the interpreter's ABI. Imported first by `serving.router`, this
module puts the build matching the sources on disk ahead of them on the package's path, so an
edited module is never shadowed by an older build: it runs as Python until it is built again.
A build counts only when its completion mark names the same digest as its folder and its
shared library loads; otherwise the router runs as Python. The compiled modules decide exactly
as the Python ones (`tests/serving/test_router_native.py` runs the same decisions through
both); they are about twice as fast (`bench/router.py`).

Compiled, the modules' classes take no weak references and no Python subclasses, and their
fields hold their declared types (an int given for a float field becomes a float; a float
given for an int field is a TypeError): callers build them from parsed values.

`PLATFORM_ROUTER_PURE=1` keeps the router in Python whatever is built. Nothing here imports
mypyc: a deployment without the build, or without a C compiler, runs the same router in Python.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import sysconfig
import warnings
from pathlib import Path

# The modules a decision runs through, compiled together (they call each other natively and
# import nothing else of the project, so their sources are all a build depends on).
MODULES = ("canary", "contracts", "index", "predict", "prefix", "policies")
# mypyc's shared library of the group, a top-level module named after it.
GROUP = "serving_router"
# Written last into a build's serving/router folder: the digest of the sources compiled.
COMPLETE = ".complete"

PACKAGE_DIR = Path(__file__).resolve().parent
BUILDS_DIR = PACKAGE_DIR.parent.parent / "var" / "router-native"
PURE_VARIABLE = "PLATFORM_ROUTER_PURE"


def source_digest(package_dir: Path | None = None) -> str:
    """What a build must have been made from: the modules' sources and the ABI it runs on."""
    package_dir = package_dir or PACKAGE_DIR
    digest = hashlib.sha256(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    for module in MODULES:
        digest.update(module.encode())
        digest.update((package_dir / f"{module}.py").read_bytes())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where the build of the current sources is, or would be."""
    return BUILDS_DIR / source_digest()


def is_complete(build: Path) -> bool:
    """Whether `build` is a finished build of the sources its name says, every module in it."""
    compiled = build / "serving" / "router"
    try:
        if (compiled / COMPLETE).read_text().strip() != build.name:
            return False
    except OSError:
        return False
    suffix = str(sysconfig.get_config_var("EXT_SUFFIX"))
    return (build / f"{GROUP}__mypyc{suffix}").is_file() and all(
        (compiled / f"{module}{suffix}").is_file() for module in MODULES
    )


def active() -> bool:
    """Whether the router's modules were loaded from the compiled build."""
    files = [getattr(sys.modules.get(f"serving.router.{m}"), "__file__", None) for m in MODULES]
    return all(file is not None and not file.endswith(".py") for file in files)


def pure() -> bool:
    """Whether PLATFORM_ROUTER_PURE asks for the Python modules; a value it cannot read stops
    the import with a message that names it."""
    value = os.environ.get(PURE_VARIABLE, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{PURE_VARIABLE}={value!r}: expected 1/true/yes/on or 0/false/no/off")


def _activate() -> None:
    if pure():
        return
    try:
        build = build_dir()
    except OSError:  # a source missing or unreadable: nothing to match a build against
        return
    if not is_complete(build):
        return
    package = sys.modules[__package__]
    # Before the sources on the package's path, so `serving.router.policies` is the build's;
    # the group's shared library is a top-level module, found at the end of sys.path.
    compiled = str(build / "serving" / "router")
    package.__path__.insert(0, compiled)
    appended = str(build) not in sys.path
    if appended:
        sys.path.append(str(build))
    try:
        importlib.import_module(f"{GROUP}__mypyc")
    except ImportError as error:  # built for another libc, truncated, ...: run as Python
        package.__path__.remove(compiled)
        if appended:
            sys.path.remove(str(build))
        warnings.warn(f"router: the compiled build does not load ({error})", stacklevel=1)


_activate()
