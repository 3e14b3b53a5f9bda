"""The router's compiled build: loaded only while it matches the sources, and deciding exactly
as the Python modules do (`serving/router/native.py`, `scripts/build_router.py`)."""

from __future__ import annotations

import ast
import copyreg
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import serving.router
from serving.router import native

ROOT = Path(__file__).resolve().parents[2]

# Every policy, ours and the peers', over bench/router.py's fleet (four GPU classes, a canary
# split, stale, unhealthy and breaker-open replicas, adapters, regions, shared prefixes), with
# telemetry and in-flight counts moving between decisions: each decision's replica, reason and
# predicted figures, as exact floats, into one digest per policy.
DECISIONS = """
import hashlib, json, random, sys
sys.path.insert(0, "bench")
import router as bench
from serving.router import POLICIES, DeploymentRoute, ModelRoute, PrefixIndex, RouterState, native

routes = [ModelRoute(bench.MODEL, (DeploymentRoute("stable", "v1", 90), DeploymentRoute("canary", "v2", 10)))]
digests = {}
for name in sorted(POLICIES):
    rng, now = random.Random(3), 1_000.0
    state = RouterState(routes, bench.build_fleet(300, rng, now), seed=3, prefix_index=PrefixIndex())
    policy = POLICIES[name](state)
    digest, in_flight = hashlib.sha256(), []
    for request in bench.build_requests(1500, rng):
        d = policy.choose(request, now)
        digest.update(repr((d.replica and d.replica.replica_id, d.reason, d.deployment_id,
                            d.predicted_ttft_s, d.predicted_tpot_s, d.predicted_cost_usd,
                            d.cached_tokens, d.meets_slo, d.queue_advised,
                            d.baseline_replica and d.baseline_replica.replica_id)).encode())
        if d.replica is not None:
            state.request_started(d.replica.replica_id, request.prompt_tokens)
            in_flight.append(d.replica.replica_id)
        if len(in_flight) > 100:
            state.request_finished(in_flight.pop(rng.randrange(len(in_flight))))
        now += 0.01
        replica = state.replica(f"r{rng.randrange(300)}")
        running = max(0, replica.running + rng.randint(-3, 3))
        state.update_telemetry(replica.replica_id, running=running, waiting=replica.waiting,
                               kv_usage=min(0.99, running / 64), telemetry_at=now)
    digests[name] = digest.hexdigest()
print(json.dumps({"native": native.active(), "digests": digests}))
"""


def decide(pure: bool) -> dict:
    env = {**os.environ, "PLATFORM_ROUTER_PURE": "1" if pure else "0"}
    done = subprocess.run(
        [sys.executable, "-c", DECISIONS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def built() -> bool:
    """Whether the compiled build of the current sources is there, made if it can be. CI has a
    C compiler and Python's headers, so there a build that cannot be made fails the test."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import build_router
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    if build_router.build() is not None:
        return True
    if os.environ.get("CI"):
        pytest.fail("the router's compiled build could not be made (scripts/build_router.py)")
    return False


def test_the_compiled_router_decides_exactly_as_the_python_one() -> None:
    if not built():
        pytest.skip("no compiled build on this machine (no C compiler or Python headers)")

    compiled, python = decide(pure=False), decide(pure=True)

    assert compiled["native"] is True
    assert python["native"] is False
    assert compiled["digests"] == python["digests"]
    assert len(python["digests"]) >= 8  # every policy, ours and the peers'


def fake_build(build: Path, *, mark: str | None = None) -> None:
    """A build's files, empty: enough for the checks before its library is loaded."""
    compiled = build / "serving" / "router"
    compiled.mkdir(parents=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    (build / f"{native.GROUP}__mypyc{suffix}").write_bytes(b"")
    for module in native.MODULES:
        (compiled / f"{module}{suffix}").write_bytes(b"")
    (compiled / native.COMPLETE).write_text((mark or build.name) + "\n")


@pytest.fixture
def builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of builds of its own, the router's package path restored afterwards."""
    # Without the real build, loaded or on the path, so a fake build's library is looked up.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if str(native.BUILDS_DIR) not in p])
    monkeypatch.delitem(sys.modules, f"{native.GROUP}__mypyc", raising=False)
    monkeypatch.setattr(native, "BUILDS_DIR", tmp_path / "builds")
    monkeypatch.delenv(native.PURE_VARIABLE, raising=False)
    monkeypatch.setattr(serving.router, "__path__", list(serving.router.__path__))
    return tmp_path / "builds"


def test_a_build_of_other_sources_is_never_loaded(
    builds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "router"
    sources.mkdir()
    for module in native.MODULES:
        shutil.copy(native.PACKAGE_DIR / f"{module}.py", sources / f"{module}.py")
    monkeypatch.setattr(native, "PACKAGE_DIR", sources)
    before_edit = native.build_dir()
    fake_build(before_edit)

    # An edit to one module: the build made before it no longer matches.
    with (sources / "predict.py").open("a") as source:
        source.write("\n# edited\n")
    path_before = list(serving.router.__path__)
    native._activate()

    assert native.build_dir() != before_edit
    assert list(serving.router.__path__) == path_before


def test_a_build_whose_mark_names_other_sources_is_never_loaded(builds: Path) -> None:
    fake_build(native.build_dir(), mark="0123456789abcdef")
    path_before = list(serving.router.__path__)

    native._activate()

    assert not native.is_complete(native.build_dir())
    assert list(serving.router.__path__) == path_before


def test_a_build_whose_library_does_not_load_leaves_the_router_in_python(builds: Path) -> None:
    fake_build(native.build_dir())
    path_before, sys_path_before = list(serving.router.__path__), list(sys.path)

    with pytest.warns(UserWarning, match="does not load"):
        native._activate()

    assert list(serving.router.__path__) == path_before
    assert sys.path == sys_path_before


def test_a_value_of_platform_router_pure_it_cannot_read_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(native.PURE_VARIABLE, "sometimes")

    with pytest.raises(ValueError, match="PLATFORM_ROUTER_PURE"):
        native.pure()


def test_the_compiled_modules_import_only_one_another() -> None:
    """A build depends on these sources alone (mypyc inlines the Final values of what they
    import), so they may import the standard library and each other, nothing else."""
    for module in native.MODULES:
        tree = ast.parse((native.PACKAGE_DIR / f"{module}.py").read_text())
        tree.body = [  # `if TYPE_CHECKING:` imports are for the type checker alone
            node
            for node in tree.body
            if not (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
        ]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                inside = name.startswith("serving.router.") and name.split(".")[2] in native.MODULES
                assert inside or top in sys.stdlib_module_names or top == "__future__", (
                    f"serving/router/{module}.py imports {name}"
                )


def test_every_frozen_dataclass_of_the_compiled_modules_pickles_by_its_constructor() -> None:
    for module in native.MODULES:
        loaded = importlib.import_module(f"serving.router.{module}")
        for value in vars(loaded).values():
            if (
                isinstance(value, type)
                and value.__module__ == loaded.__name__
                and dataclasses.is_dataclass(value)
                and value.__dataclass_params__.frozen  # type: ignore[attr-defined]
            ):
                assert value in copyreg.dispatch_table, f"{value.__qualname__} is not registered"
