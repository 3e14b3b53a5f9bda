"""The router's hot path compiled with mypyc, used when a build of these very sources exists.

`scripts/build_router.py` compiles `MODULES` into `var/router-native/<digest>/`, the digest
taken over their sources and the interpreter's ABI. Imported first by `serving.router`, this
module puts the build matching the sources on disk ahead of them on the package's path, so an
edited module is never shadowed by an older build: it runs as Python until it is built again.
The compiled modules decide exactly as the Python ones (`tests/serving/test_router_native.py`
runs the same decisions through both); they are about twice as fast (`bench/router.py`).

`PLATFORM_ROUTER_PURE=1` keeps the router in Python whatever is built. Nothing here imports
mypyc: a deployment without the build, or without a C compiler, runs the same router in Python.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

# The modules a decision runs through, compiled together (they call each other natively).
MODULES = ("canary", "contracts", "index", "predict", "prefix", "policies")
# mypyc's shared library of the group, a top-level module named after it.
GROUP = "serving_router"

PACKAGE_DIR = Path(__file__).resolve().parent
BUILDS_DIR = PACKAGE_DIR.parent.parent / "var" / "router-native"


def source_digest() -> str:
    """What a build must have been made from: the modules' sources and the ABI it runs on."""
    digest = hashlib.sha256(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    for module in MODULES:
        digest.update(module.encode())
        digest.update((PACKAGE_DIR / f"{module}.py").read_bytes())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where the build of the current sources is, or would be."""
    return BUILDS_DIR / source_digest()


def active() -> bool:
    """Whether the router's modules were loaded from the compiled build."""
    files = [getattr(sys.modules.get(f"serving.router.{m}"), "__file__", None) for m in MODULES]
    return all(file is not None and not file.endswith(".py") for file in files)


def _activate() -> None:
    if os.environ.get("PLATFORM_ROUTER_PURE", "").lower() in ("1", "true", "yes"):
        return
    try:
        build = build_dir()
    except OSError:  # a source missing or unreadable: nothing to match a build against
        return
    compiled = build / "serving" / "router"
    if not (compiled / ".complete").exists():
        return
    package = sys.modules[__package__]
    # Before the sources on the package's path, so `serving.router.policies` is the build's;
    # the group's shared library is a top-level module, found at the end of sys.path.
    package.__path__.insert(0, str(compiled))
    if str(build) not in sys.path:
        sys.path.append(str(build))


_activate()
