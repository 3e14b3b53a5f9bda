"""The router's compiled build: loaded only while it matches the sources, and deciding exactly
as the Python modules do (`serving/router/native.py`, `scripts/build_router.py`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
        digest.update(repr((d.replica and d.replica.replica_id, d.reason, d.predicted_ttft_s,
                            d.predicted_tpot_s, d.predicted_cost_usd, d.cached_tokens,
                            d.meets_slo, d.baseline_replica and d.baseline_replica.replica_id)).encode())
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


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the router runs as Python")
def test_the_compiled_router_decides_exactly_as_the_python_one() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import build_router
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert build_router.build() is not None

    compiled, python = decide(pure=False), decide(pure=True)

    assert compiled["native"] is True
    assert python["native"] is False
    assert compiled["digests"] == python["digests"]
    assert len(python["digests"]) >= 8  # every policy, ours and the peers'


def test_a_build_of_other_sources_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "router"
    sources.mkdir()
    for module in native.MODULES:
        shutil.copy(native.PACKAGE_DIR / f"{module}.py", sources / f"{module}.py")
    monkeypatch.setattr(native, "PACKAGE_DIR", sources)
    monkeypatch.setattr(native, "BUILDS_DIR", tmp_path / "builds")
    built = native.build_dir() / "serving" / "router"
    built.mkdir(parents=True)
    (built / ".complete").write_text("")

    # An edit to one module: the build made before it no longer matches.
    with (sources / "predict.py").open("a") as source:
        source.write("\n# edited\n")
    path_before = list(serving.router.__path__)
    native._activate()

    assert native.build_dir() != built.parent.parent
    assert list(serving.router.__path__) == path_before


def test_the_build_of_the_current_sources_goes_first_on_the_package_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "BUILDS_DIR", tmp_path / "builds")
    monkeypatch.delenv("PLATFORM_ROUTER_PURE", raising=False)
    built = native.build_dir() / "serving" / "router"
    built.mkdir(parents=True)
    (built / ".complete").write_text("")
    monkeypatch.setattr(serving.router, "__path__", list(serving.router.__path__))
    monkeypatch.setattr(sys, "path", list(sys.path))

    native._activate()

    assert serving.router.__path__[0] == str(built)
    assert str(native.build_dir()) in sys.path


def test_a_build_without_its_completion_mark_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "BUILDS_DIR", tmp_path / "builds")
    monkeypatch.delenv("PLATFORM_ROUTER_PURE", raising=False)
    (native.build_dir() / "serving" / "router").mkdir(parents=True)
    monkeypatch.setattr(serving.router, "__path__", list(serving.router.__path__))
    path_before = list(serving.router.__path__)

    native._activate()

    assert list(serving.router.__path__) == path_before
