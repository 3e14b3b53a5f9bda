"""A multi-model fleet, planned per model, against every model on the best single GPU class.

    .venv/bin/python bench/multimodel.py [--quick] [--seed 0] [--rate 40] [--duration 300]
        [--max-gpus 64] [--json FILE]

The workload: Poisson arrivals at --rate requests/s for --duration seconds (--quick: 30 s),
the simulator's default length mix (chat, RAG, long documents) and tenants (60 % of traffic
interactive), each request asking for a model by share: llama-3.1-70b 20 %, llama-3.1-8b
50 %, llama-3.2-1b 30 %, all from --seed. No LoRA tenants: the simulator passes no adapter
to its engines, so an adapter would change nothing it models.

The planner's mix: per model, `plan_capacity` over every GPU class of gpus.csv at every
tensor-parallel degree from the smallest whose weights leave room for KV up to 8 (a 70B
starts at TP 4 on 80 GB and 48 GB GPUs, TP 2 on an H200 or an RTX PRO 6000, TP 8 on an L4),
with the model's arrival rate and mean prompt and output tokens from the workload, the
interactive tier's objectives and the planner's default headroom. The planner judges a
pool by the mean prompt, so the bench prints the share of each model's interactive requests
whose prefill misses the TTFT objective even on an idle replica of the pool it chose. The
pools of all three plans make one fleet, each pool serving its own model, run under
cost_aware, least_load and the faithful peers (llm_d_epp, dynamo_kv, round_robin), each at
its own telemetry interval.

The baseline: per model and GPU class, the cheapest over the same TP degrees of the smallest
homogeneous fleets on which cost_aware meets the SLO on that model's requests alone
(bench/routing.py's doubling-then-bisecting search, up to --max-gpus GPUs); a degree whose
idle prefill already misses the TTFT objective on more than 1 % of the model's interactive
requests is skipped. "Every model on the best single class" is the class whose three fleets
cost least together; those fleets make one fleet, run under cost_aware and least_load.
The searched mix: each model on the class (and TP degree) of that table whose fleet costs
least, the three fleets as one, run under the same five policies as the planner's mix.
Models share no replica in the simulator, so it should meet the SLO as each of its fleets
did alone; the bench says so where it does not. The verdict gives, per mixed fleet, the
policy with the highest interactive both-clock attainment and cost_aware against the best
of the others.
Tensor parallelism is the engine model's: ideal, n GPUs' bandwidth and FLOPS, no
all-reduce cost (serving/engine/perf.py), which flatters high TP degrees.

The SLO, as in bench/routing.py: >= 99 % of interactive requests within both the TTFT (1 s)
and the TPOT (50 ms) objectives of the default tiers, failed requests counting as misses;
the table gives that share per model and over all interactive requests. $/h is the fleet's
list price per hour (gpus.csv) at its size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.routing import SLO_SHARE, SizeSearch, attainment, meets, search_size
from serving.capacity.planner import CapacityPlan, PoolOption, Workload, plan_capacity
from serving.clustersim.fleet import (
    TENSOR_PARALLEL_DEGREES,
    FleetSpec,
    PoolSpec,
    pool_name,
    smallest_tensor_parallel,
)
from serving.clustersim.report import Summary, summarize
from serving.clustersim.simulator import SimConfig, simulate
from serving.clustersim.workloads import SimRequest, assign_models, poisson
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from serving.router import DEFAULT_SLO_TIERS

SHARES = {"llama-3.1-70b": 0.2, "llama-3.1-8b": 0.5, "llama-3.2-1b": 0.3}
MODELS = tuple(SHARES)
POLICIES = ("cost_aware", "least_load", "llm_d_epp", "dynamo_kv", "round_robin")
BASELINE_POLICIES = ("cost_aware", "least_load")
RATE_PER_S = 40.0
DURATION_S = 300.0
QUICK_DURATION_S = 30.0
MAX_GPUS = 64
INTERACTIVE = DEFAULT_SLO_TIERS["interactive"]


def workload(rate_per_s: float, duration_s: float, seed: int) -> list[SimRequest]:
    return assign_models(poisson(rate_per_s, duration_s, seed=seed), SHARES, seed=seed + 1)


def of_model(requests: list[SimRequest], model: str) -> list[SimRequest]:
    return [r for r in requests if r.model == model]


def short(model: str) -> str:
    return model.rsplit("-", 1)[-1]


def run(fleet: FleetSpec, requests: list[SimRequest], policy: str) -> Summary:
    # Each policy at its own refresh interval, as bench/routing.py runs them by default.
    return summarize(simulate(fleet, requests, SimConfig(policy=policy, telemetry_interval_s=None)))


# --- the planner's mix ------------------------------------------------------------------------


def degrees(gpu: str, model: str) -> list[int]:
    """The TP degrees a replica of `model` on this class can have: from the smallest whose
    weights leave room for KV up to 8."""
    smallest = smallest_tensor_parallel(gpu, model)
    return [] if smallest is None else [d for d in TENSOR_PARALLEL_DEGREES if d >= smallest]


def pool_options(model: str) -> list[PoolOption]:
    return [
        PoolOption(f"{pool_name(gpu)}-tp{degree}", gpu, tensor_parallel=degree)
        for gpu in load_gpu_specs()
        for degree in degrees(gpu, model)
    ]


def plan(model: str, requests: list[SimRequest], duration_s: float) -> CapacityPlan:
    mine = of_model(requests, model)
    return plan_capacity(
        Workload(
            users=1,
            requests_per_user_s=len(mine) / duration_s,
            prompt_tokens=round(statistics.fmean(r.prompt_tokens for r in mine)),
            output_tokens=round(statistics.fmean(r.output_tokens for r in mine)),
            ttft_slo_s=INTERACTIVE.ttft_s,
            tpot_slo_s=INTERACTIVE.tpot_s,
            model=model,
        ),
        pool_options(model),
    )


def planned_fleet(plans: dict[str, CapacityPlan]) -> FleetSpec:
    pools = []
    for model, capacity in plans.items():
        for line in capacity.lines:
            pools.append(
                PoolSpec(
                    f"{line.pool}-{short(model)}",
                    line.gpu_class,
                    line.replicas,
                    tensor_parallel=line.gpus // line.replicas,
                    model=model,
                )
            )
    return FleetSpec(pools=tuple(pools))


# --- the single-class baseline ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClassFit:
    """The smallest homogeneous fleet of one class meeting the SLO for one model."""

    replicas: int
    tensor_parallel: int
    usd_per_hour: float


def combined_fleet(choices: dict[str, tuple[str, ClassFit]]) -> FleetSpec:
    """One fleet of a pool per model: its class and smallest fleet there, serving only it."""
    pools = tuple(
        PoolSpec(
            f"{pool_name(gpu)}-{short(model)}",
            gpu,
            fit.replicas,
            tensor_parallel=fit.tensor_parallel,
            model=model,
        )
        for model, (gpu, fit) in choices.items()
    )
    return FleetSpec(pools=pools)


def single_class(gpu: str, fits: dict[str, ClassFit]) -> FleetSpec:
    return combined_fleet({model: (gpu, fit) for model, fit in fits.items()})


def idle_misses(gpu: str, model: str, degree: int, requests: list[SimRequest]) -> float:
    """The share of the model's interactive requests whose prefill alone, on an idle replica
    of this class and TP degree, misses the TTFT objective: no number of replicas helps."""
    asked = [r for r in requests if r.tier == "interactive"]
    if not asked:
        return 0.0
    perf = PerfModel(load_gpu_specs()[gpu], load_model_specs()[model], tensor_parallel=degree)
    limit = INTERACTIVE.ttft_s or float("inf")
    return sum(1 for r in asked if perf.ttft_s(r.prompt_tokens) > limit) / len(asked)


def smallest_single_class(
    gpu: str, model: str, requests: list[SimRequest], max_size: int
) -> ClassFit | None:
    """The cheapest, over the TP degrees the model fits at, of the smallest fleets of this
    class on which cost_aware meets the SLO on the model's requests; None when none does."""
    mine = of_model(requests, model)
    price = load_gpu_specs()[gpu].usd_per_hour
    best: ClassFit | None = None
    for degree in degrees(gpu, model):
        if best is not None and degree * price >= best.usd_per_hour:
            break  # one replica at this degree already costs the fleet found
        if idle_misses(gpu, model, degree, mine) > 1 - SLO_SHARE:
            continue

        def evaluate(size: int, degree: int = degree) -> Summary:
            fit = ClassFit(size, degree, 0.0)
            return run(single_class(gpu, {model: fit}), mine, "cost_aware")

        found: SizeSearch = search_size(evaluate, meets, attainment, max_size // degree)
        if found.replicas is not None:
            hourly = found.replicas * degree * price
            if best is None or hourly < best.usd_per_hour:
                best = ClassFit(found.replicas, degree, hourly)
    return best


def best_single_class(searches: dict[str, dict[str, ClassFit | None]]) -> str | None:
    """The class on which all the models' smallest fleets cost least together."""
    hourly = {
        gpu: sum(fit.usd_per_hour for fit in by_model.values() if fit is not None)
        for gpu, by_model in searches.items()
        if all(fit is not None for fit in by_model.values())
    }
    return min(hourly, key=lambda gpu: hourly[gpu]) if hourly else None


def searched_mix(
    searches: dict[str, dict[str, ClassFit | None]],
) -> dict[str, tuple[str, ClassFit]] | None:
    """Each model on the class whose smallest fleet meeting the SLO costs least (the first
    such class in the table on a tie); None when some model has no fit on any class."""
    models = dict.fromkeys(model for by_model in searches.values() for model in by_model)
    mix: dict[str, tuple[str, ClassFit]] = {}
    for model in models:
        fits = [
            (gpu, fit)
            for gpu, by_model in searches.items()
            if (fit := by_model.get(model)) is not None
        ]
        if not fits:
            return None
        mix[model] = min(fits, key=lambda choice: choice[1].usd_per_hour)
    return mix


# --- the table --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    policy: str
    fleet: str
    usd_per_hour: float
    by_model: dict[str, float | None]
    overall: float
    failed: int


def row(label: str, policy: str, fleet: FleetSpec, summary: Summary) -> Row:
    by_model = {m: f.interactive_slo_attainment for m, f in summary.models.items()}
    return Row(
        label=label,
        policy=policy,
        fleet=fleet.describe(),
        usd_per_hour=fleet.hourly_cost,
        by_model=by_model,
        overall=attainment(summary),
        failed=summary.failed,
    )


def format_row(r: Row) -> str:
    cells = " ".join(
        f"{v:>8.2%}" if (v := r.by_model.get(m)) is not None else f"{'-':>8}" for m in MODELS
    )
    return f"{r.label:<10} {r.policy:<12} {r.usd_per_hour:>8.2f} {cells} {r.overall:>8.2%}"


HEADER = (
    f"{'fleet':<10} {'policy':<12} {'$/h':>8} "
    + " ".join(f"{short(m):>8}" for m in MODELS)
    + f" {'all':>8}"
)


def judged(r: Row) -> str:
    met = "meets" if r.overall >= SLO_SHARE else "MISSES"
    return f"${r.usd_per_hour:.2f}/h, {r.overall:.2%} ({met} the SLO)"


def verdict(name: str, mixed: Row, baseline: Row | None, best: str | None) -> str:
    """A mixed fleet under cost_aware against every model on the best single class."""
    mix = f"verdict: {name} under cost_aware {judged(mixed)}"
    if baseline is None:
        return f"{mix}; no single class serves every model within the SLO"
    ratio = mixed.usd_per_hour / baseline.usd_per_hour
    return (
        f"{mix}; every model on {best} under cost_aware {judged(baseline)}; "
        f"the mix costs {ratio:.2f}x the single class"
    )


def best_policies(rows: list[Row]) -> list[str]:
    """The policies with the highest interactive both-clock attainment overall (ties: all)."""
    top = max(r.overall for r in rows)
    return [r.policy for r in rows if r.overall == top]


def policy_verdict(name: str, rows: list[Row]) -> str:
    """Which policy does best on one fleet, and cost_aware against the best of the others."""
    top = max(r.overall for r in rows)
    ours = next(r for r in rows if r.policy == "cost_aware")
    others = [r for r in rows if r.policy != "cost_aware"]
    rival = max(r.overall for r in others)
    rivals = "/".join(r.policy for r in others if r.overall == rival)
    return (
        f"best policy on the {name}: {', '.join(best_policies(rows))} ({top:.2%}); "
        f"cost_aware {ours.overall:.2%} vs the best other, {rivals} {rival:.2%}: "
        f"{(ours.overall - rival) * 100:+.2f} points"
    )


def shortfalls(r: Row) -> dict[str, float]:
    """The models whose interactive requests fall short of the SLO on this row's run."""
    return {m: v for m, v in r.by_model.items() if v is not None and v < SLO_SHARE}


def describe_fit(fit: ClassFit | None) -> str:
    return (
        "-" if fit is None else f"{fit.replicas}xTP{fit.tensor_parallel} ${fit.usd_per_hour:.2f}/h"
    )


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_DURATION_S:.0f} s window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=RATE_PER_S, help="requests/s, all models")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    parser.add_argument(
        "--max-gpus", type=int, default=MAX_GPUS, help="largest fleet searched, per model"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    return parser.parse_args()


def main() -> int:
    args = parse_arguments()
    started = time.monotonic()
    duration = args.duration or (QUICK_DURATION_S if args.quick else DURATION_S)
    requests = workload(args.rate, duration, args.seed)
    counts = {m: len(of_model(requests, m)) for m in MODELS}
    print(
        f"{len(requests)} requests over {duration:.0f} s at {args.rate:g}/s (seed {args.seed}): "
        + ", ".join(f"{m} {n}" for m, n in counts.items())
    )

    plans = {m: plan(m, requests, duration) for m in MODELS}
    for model, capacity in plans.items():
        lines = ", ".join(
            f"{ln.replicas}x {ln.gpu_class} ({ln.gpus} GPUs)" for ln in capacity.lines
        )
        unmet = "" if capacity.meets_demand else f" UNMET {capacity.unmet_tokens_per_s:.0f} tok/s"
        print(f"plan {model}: {lines or 'nothing'} ${capacity.usd_per_hour:.2f}/h{unmet}")
        # The planner sizes by the mean prompt; the tail may miss the TTFT objective anyway.
        for ln in capacity.lines:
            share = idle_misses(
                ln.gpu_class, model, ln.gpus // ln.replicas, of_model(requests, model)
            )
            print(
                f"  {share:.2%} of its interactive requests miss the TTFT objective even on an idle {ln.gpu_class} TP{ln.gpus // ln.replicas}"
            )
    mix = planned_fleet(plans)
    planner_rows = [row("planner", p, mix, run(mix, requests, p)) for p in POLICIES]

    searches = {
        gpu: {m: smallest_single_class(gpu, m, requests, args.max_gpus) for m in MODELS}
        for gpu in load_gpu_specs()
    }
    print("smallest fleet per class meeting the SLO per model (cost_aware; replicas x TP):")
    for gpu, by_model in searches.items():
        sizes = ", ".join(f"{short(m)} {describe_fit(f)}" for m, f in by_model.items())
        print(f"  {gpu:<18} {sizes}")

    choices = searched_mix(searches)
    searched_rows: list[Row] = []
    if choices is not None:
        searched = combined_fleet(choices)
        searched_rows = [row("searched", p, searched, run(searched, requests, p)) for p in POLICIES]

    best = best_single_class(searches)
    single_rows: list[Row] = []
    if best is not None:
        fits = {m: f for m, f in searches[best].items() if f is not None}
        fleet = single_class(best, fits)
        single_rows = [row("single", p, fleet, run(fleet, requests, p)) for p in BASELINE_POLICIES]
    baseline = single_rows[0] if single_rows else None

    print(f"planner  = {mix.describe()}")
    if searched_rows:
        print(f"searched = {searched_rows[0].fleet}")
    else:
        print("searched = none: some model has no fleet meeting the SLO on any class")
    if single_rows:
        print(f"single   = {single_rows[0].fleet}")
    print("interactive requests within both TTFT and TPOT objectives, per model and overall")
    print(HEADER)
    rows = planner_rows + searched_rows + single_rows
    for r in rows:
        print(format_row(r) + (f"  ({r.failed} failed)" if r.failed else ""))
    print(verdict("planner's mix", planner_rows[0], baseline, best))
    if searched_rows:
        print(verdict("searched mix", searched_rows[0], baseline, best))
        # Each pool met the SLO on its own model's requests alone; models share no replica in
        # the simulator, so the combined run should too. Say so where it does not.
        if missed := shortfalls(searched_rows[0]):
            print(
                "  the searched mix under cost_aware falls short on "
                + ", ".join(f"{short(m)} {share:.2%}" for m, share in missed.items())
                + " although each model's pool met the SLO on its requests alone"
            )
    print(policy_verdict("planner's mix", planner_rows))
    if searched_rows:
        print(policy_verdict("searched mix", searched_rows))
    print(f"wall {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "seed": args.seed,
                    "rate_per_s": args.rate,
                    "duration_s": duration,
                    "rows": [asdict(r) for r in rows],
                    "single_class_fits": {
                        gpu: {m: asdict(f) if f else None for m, f in by_model.items()}
                        for gpu, by_model in searches.items()
                    },
                    "best_single_class": best,
                    "searched_mix": None
                    if choices is None
                    else {m: {"gpu_class": gpu, **asdict(f)} for m, (gpu, f) in choices.items()},
                    "best_policies": {
                        label: best_policies(fleet_rows)
                        for label, fleet_rows in (
                            ("planner", planner_rows),
                            ("searched", searched_rows),
                        )
                        if fleet_rows
                    },
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
