"""Decision time of each routing policy at 10 to 10,000 candidate replicas of one model.

    .venv/bin/python bench/router.py [--sizes 10,100,1000,10000] [--decisions 5000]
    .venv/bin/python bench/router.py --policies cost_aware --baseline 770b8e3 --rounds 7

Prints a table of p50 and p99 microseconds per decision (each cell runs `--rounds` times
with different seeds and shows the round with the median p99, because a shared machine's
noise lands in the tail), with PASS/FAIL against the target
(p99 under 50 us; the target is set for the cost-aware policy, the others are shown
against it for comparison). The fleet is llama-3.1-8b on H100, A100, L40S and L4 in two
regions, in a 90/10 canary split, with random load (0-64 sequences running, plus `--busy`),
a few stale, unhealthy and breaker-open replicas; requests mix tiers, tenants with shared
prefixes, LoRA adapters and region restrictions. In-flight counts move as requests start
and finish, outside the timed section, as they would in the gateway.

`--baseline REV` loads serving/router/policies.py and serving/router/prefix.py as of git
revision REV beside the current ones and runs the two interleaved (alternating which goes first), each cell `--rounds`
times, showing the median p50 and median p99 of each: before/after under the same noise. The
baseline runs as Python: compare with `PLATFORM_ROUTER_PURE=1` for like against like.

The router runs compiled when `make router` has built it (`serving/router/native.py`); the
first line printed says which.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.router import (
    POLICIES,
    DeploymentRoute,
    ModelRoute,
    PrefixIndex,
    ReplicaPerf,
    ReplicaState,
    RouteRequest,
    RouterState,
    native,
)
from serving.router.coefficients import coefficients_from_perf
from serving.router.contracts import Tier

TARGET_P99_US = 50.0
MODEL = "llama-3.1-8b"
GPU_CLASSES = ("H100-SXM-80GB", "A100-SXM-80GB", "L40S-48GB", "L4-24GB")
REGIONS = ("eu-west", "us-east")
TIERS: tuple[Tier, ...] = ("interactive", "standard", "batch")


def gpu_shapes() -> dict[str, tuple[ReplicaPerf, float]]:
    gpus = load_gpu_specs()
    model = load_model_specs()[MODEL]
    shapes = {}
    for gpu_class in GPU_CLASSES:
        perf = PerfModel(gpus[gpu_class], model)
        shapes[gpu_class] = (coefficients_from_perf(perf), gpus[gpu_class].usd_per_hour)
    return shapes


def build_fleet(size: int, rng: random.Random, now: float, busy: int = 0) -> list[ReplicaState]:
    shapes = gpu_shapes()
    replicas = []
    for index in range(size):
        gpu_class = GPU_CLASSES[index % len(GPU_CLASSES)]
        perf, price = shapes[gpu_class]
        running = rng.randint(0, 64) + busy
        replicas.append(
            ReplicaState(
                replica_id=f"r{index}",
                deployment_id="canary" if index % 10 == 0 else "stable",
                model=MODEL,
                version="v2" if index % 10 == 0 else "v1",
                pool=f"{gpu_class}-{REGIONS[index % 2]}",
                gpu_class=gpu_class,
                region=REGIONS[(index // len(GPU_CLASSES)) % len(REGIONS)],
                price_per_hour=price,
                perf=perf,
                running=running,
                waiting=rng.choice((0, 0, 0, 1, 4)),
                kv_usage=min(0.99, running / 64 * rng.uniform(0.6, 1.2)),
                adapters_loaded=frozenset({"support-bot"}) if rng.random() < 0.2 else frozenset(),
                max_loras=4,
                healthy=rng.random() > 0.02,
                breaker_open_until=now + 30 if rng.random() < 0.01 else 0.0,
                telemetry_at=now
                - (rng.uniform(6, 10) if rng.random() < 0.05 else rng.uniform(0, 3)),
            )
        )
    return replicas


def build_requests(count: int, rng: random.Random) -> list[RouteRequest]:
    tenants = [f"tenant-{n}" for n in range(50)]
    requests = []
    for index in range(count):
        tenant = rng.choice(tenants)
        prompt_family = rng.randrange(20)
        blocks = rng.randint(1, 16)
        requests.append(
            RouteRequest(
                model=MODEL,
                tenant=tenant,
                tier=rng.choice(TIERS),
                prompt_tokens=blocks * 16 + rng.randint(0, 2000),
                max_tokens=rng.choice((64, 256, 1024)),
                request_id=f"req-{index}",
                adapter="support-bot" if rng.random() < 0.1 else None,
                prefix_hashes=tuple(hash((tenant, prompt_family, b)) for b in range(blocks)),
                allowed_regions=frozenset({"eu-west"}) if rng.random() < 0.2 else None,
            )
        )
    return requests


def measure(
    policy_name: str,
    size: int,
    decisions: int,
    seed: int,
    policies: dict[str, type] | None = None,
    prefix_index: type[PrefixIndex] = PrefixIndex,
    busy: int = 0,
) -> tuple[int, float, float]:
    rng = random.Random(seed)
    now = 1_000.0
    routes = [
        ModelRoute(
            MODEL,
            (DeploymentRoute("stable", "v1", 90), DeploymentRoute("canary", "v2", 10)),
        )
    ]
    state = RouterState(
        routes, build_fleet(size, rng, now, busy), seed=seed, prefix_index=prefix_index()
    )
    policy = (policies or POLICIES)[policy_name](state)
    requests = build_requests(decisions, rng)
    in_flight: list[str] = []
    timings: list[int] = []
    # Telemetry arrives every ~2 s per replica; decisions are 1 ms apart in simulated time.
    # The replicas built stale stay stale, so that path stays exercised.
    reporting = [r for r in state_replicas(state, size) if now - r.telemetry_at < 5.0]
    refresh_per_decision = max(1, len(reporting) // 2000)
    budget_ns = 3_000_000_000  # slow baselines stop early; a few hundred samples suffice
    started = time.perf_counter_ns()
    for index, request in enumerate(requests):
        before = time.perf_counter_ns()
        decision = policy.choose(request, now)
        timings.append(time.perf_counter_ns() - before)
        if decision.replica is not None:
            state.request_started(decision.replica.replica_id)
            in_flight.append(decision.replica.replica_id)
        if len(in_flight) > 200:
            state.request_finished(in_flight.pop(rng.randrange(len(in_flight))))
        now += 0.001
        for _ in range(refresh_per_decision):
            fresh = reporting[rng.randrange(len(reporting))]
            running = max(0, fresh.running + rng.randint(-2, 2))
            state.update_telemetry(
                fresh.replica_id,
                running=running,
                waiting=fresh.waiting,
                kv_usage=min(0.99, running / 64),
                telemetry_at=now,
            )
        if index >= 200 and time.perf_counter_ns() - started > budget_ns:
            break
    timings.sort()
    p50 = timings[len(timings) // 2] / 1000
    p99 = timings[min(len(timings) - 1, int(len(timings) * 0.99))] / 1000
    return len(timings), p50, p99


def router_build() -> str:
    """Which router the benchmark runs: `serving/router/native.py`'s build, or Python."""
    return "compiled (mypyc)" if native.active() else "Python (make router compiles it)"


def state_replicas(state: RouterState, size: int) -> list[ReplicaState]:
    replicas = (state.replica(f"r{index}") for index in range(size))
    return [replica for replica in replicas if replica is not None]


def baseline_module(revision: str, module: str) -> ModuleType:
    """serving/router/`module`.py as of `revision`, importing today's other modules."""
    root = Path(__file__).resolve().parent.parent
    path = f"serving/router/{module}.py"
    source = subprocess.run(
        ["git", "show", f"{revision}:{path}"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    name = f"serving.router._baseline_{module}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # dataclasses look their module up while being built
    # The router's own source at an earlier commit of this repository (git show), run as the
    # baseline the bench compares against: no outside input reaches it.
    exec(compile(source, f"{revision}:{path}", "exec"), loaded.__dict__)  # nosec B102  # own git source
    return loaded


def compare(args: argparse.Namespace, sizes: list[int]) -> int:
    # Variant -> (policies, prefix index class): the baseline's policies always use the
    # baseline's prefix index, as the gateway at that revision would have.
    variants: dict[str, tuple[dict[str, type], type[PrefixIndex]]] = {
        f"@{args.baseline}": (
            baseline_module(args.baseline, "policies").POLICIES,
            baseline_module(args.baseline, "prefix").PrefixIndex,
        ),
        "current": (POLICIES, PrefixIndex),
    }
    print(f"router: {router_build()}; the baseline: Python")
    print(
        f"{'policy':<16} {'replicas':>8} {'variant':<12} {'p50 us':>9} {'p99 us':>9}"
        f"  per-round p99 (median of {args.rounds} interleaved rounds)"
    )
    for policy_name in args.policies.split(","):
        for size in sizes:
            results: dict[str, list[tuple[int, float, float]]] = {name: [] for name in variants}
            for n in range(args.rounds):
                # Alternate which variant goes first so drift in the noise favours neither.
                order = list(variants) if n % 2 == 0 else list(reversed(variants))
                for name in order:
                    policies, prefix_index = variants[name]
                    results[name].append(
                        measure(
                            policy_name,
                            size,
                            args.decisions,
                            args.seed + n,
                            policies,
                            prefix_index,
                            args.busy,
                        )
                    )
            for name, rounds in results.items():
                p50 = statistics.median(r[1] for r in rounds)
                p99 = statistics.median(r[2] for r in rounds)
                each = " ".join(f"{r[2]:.0f}" for r in rounds)
                print(f"{policy_name:<16} {size:>8} {name:<12} {p50:>9.1f} {p99:>9.1f}  {each}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds per cell; the table shows the round with the median p99 (shared machines are noisy)",
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="sequences added to every replica's running count: a busy fleet, where fewer"
        " of cost-aware's draws settle and it draws again",
    )
    parser.add_argument(
        "--baseline",
        help="git revision whose serving/router/policies.py and prefix.py run interleaved"
        " beside the current ones",
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    if args.baseline:
        return compare(args, sizes)

    print(f"router: {router_build()}")
    print(f"{'policy':<16} {'replicas':>8} {'decisions':>9} {'p50 us':>9} {'p99 us':>9}  target")
    for policy_name in args.policies.split(","):
        for size in sizes:
            rounds = sorted(
                (
                    measure(policy_name, size, args.decisions, args.seed + n, busy=args.busy)
                    for n in range(args.rounds)
                ),
                key=lambda result: result[2],
            )
            count, p50, p99 = rounds[len(rounds) // 2]
            verdict = "PASS" if p99 < TARGET_P99_US else "FAIL"
            print(f"{policy_name:<16} {size:>8} {count:>9} {p50:>9.1f} {p99:>9.1f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
