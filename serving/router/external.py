"""A routing policy by name: one of ours or the peers' (`POLICIES`), or one written elsewhere.

A policy written elsewhere is named `module:Class` (an importable module) or
`path/to/file.py:Class`, so the cluster simulator and `bench/routing.py` can run a router
this project did not write beside ours, on the same fleets and traffic (the other
benchmarks and the gateway take the registered names only):

    .venv/bin/python bench/routing.py --families chat --policies cost_aware,my_router.py:Mine
    .venv/bin/python -m serving.clustersim --family rag --policy my_router.py:Mine

The class has `policies.Policy`'s interface: built as `Class(state, config)` (a
`RouterState` and a `RouterConfig`), a `name`, and `choose(request, now) -> Decision`. It may
set `refresh_interval_s`, the seconds between the telemetry scrapes it expects (as the peers
in `serving/router/peers/` do); without it the simulator scrapes at its own default.
`serving/router/peers/` holds four such classes, each citing the source it follows, and
`policies.least_load_pick` and `policies._decide` are the helpers they build on. Wrap one of
our policies rather than subclass it: `make router` compiles them (mypyc), and a Python class
cannot inherit from a compiled one.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

_LOADED: dict[str, type[Any]] = {}


def is_external(name: str) -> bool:
    """Whether `name` names a policy written elsewhere (`module:Class`, `file.py:Class`)."""
    return ":" in name


def _module(where: str) -> Any:
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise ValueError(f"no file {where}")
        module_name = f"_external_policy_{abs(hash(str(path)))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{where} cannot be loaded as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return module
    return importlib.import_module(where)


def policy_class(name: str) -> type[Any]:
    """The policy class `name` names (module docstring); ValueError saying why not."""
    from serving.router import POLICIES as known  # the registry, read at each call

    if name in known:
        return known[name]
    if not is_external(name):
        raise ValueError(
            f"unknown policy {name!r}: one of {', '.join(known)}, or module:Class or "
            "file.py:Class for one written elsewhere"
        )
    if name in _LOADED:
        return _LOADED[name]
    where, _, class_name = name.rpartition(":")
    try:
        module = _module(where)
    except ValueError as error:
        raise ValueError(f"policy {name!r}: {error}") from None
    except Exception as error:  # whatever the module raises on import
        raise ValueError(f"policy {name!r}: importing {where} failed: {error!r}") from None
    policy = getattr(module, class_name, None)
    if not isinstance(policy, type) or not callable(getattr(policy, "choose", None)):
        raise ValueError(
            f"policy {name!r}: {where} has no class {class_name} with a choose(request, now)"
        )
    _LOADED[name] = policy
    return policy
