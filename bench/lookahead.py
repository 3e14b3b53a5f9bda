"""How far the routers stand from one that sees every replica's future: the smallest
homogeneous fleet meeting `bench/routing.py`'s SLO under each policy, beside the same search
under a lookahead router, the class's lower bound and its sustained floor
(`serving/capacity/lower_bound.py`).

The lookahead router is a yardstick, not a policy the product could ship: it reads each
engine's whole state, exactly and at the moment of the decision, and runs its future. For
every request it copies every replica's engine model (`Engine.copy`), runs the copy until it
drains with the request added, no later arrival in it, and compares it with the replica's
future without the request (drained once per request routed there: the engine model is
deterministic). It sends the request where adding it puts the fewest requests outside
their objectives (every tier's TTFT and TPOT where it has them, batch's first token within
the benchmark's 30 s), then where it adds least to the sum of every request's two clocks,
each over its objective (so among replicas where all meet, the one where it slows the rest
least and is served soonest). It knows the present perfectly and the future not at all,
and it is greedy: a policy it beats by much loses to a better reading of the present
(telemetry, prediction); where it does no better, better prediction alone does not close
the distance from the lower bound. It is no yardstick on an overloaded fleet: once every
replica's queue is late, one more request adds no miss anywhere and its choice goes blind
(`bench/RESULTS.md`).

    .venv/bin/python bench/lookahead.py [--families chat,code] [--spread] [--gpus L40S-48GB]
        [--duration 60] [--seed N] [--policies cost_aware,least_load] [--max-replicas 64]
        [--workers 2]

`--spread` adds the lower bound's test stream (20 interactive requests/s for 60 s, prompts of
500 to 6,000 tokens with nothing shared, outputs of 50 to 400): nothing to route for but the
balance of prefill and decode.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import routing
from serving.clustersim import SimConfig, SimRequest, summarize
from serving.clustersim.families import FamilyError, family, parse_families
from serving.clustersim.fleet import FleetSpec, homogeneous
from serving.clustersim.report import Summary
from serving.clustersim.simulator import ClusterSimulator, Gateway, SimReplica
from serving.engine.core import FINISHED, FIRST_TOKEN, Engine, EngineRequest
from serving.router.contracts import Decision, Reason, RouterConfig, RouteRequest
from serving.router.index import RouterState
from serving.router.policies import _decide, _no_route, least_load_pick

LOOKAHEAD = "lookahead"
CHECK_EVERY = 50  # arrivals between two counts of the requests sure to miss
SPREAD = "spread"


class Missed(Exception):
    """More interactive requests are sure to miss than the SLO allows: the fleet fails."""


class Lookahead:
    """Sends each request where `LookaheadSimulator` chose (`chosen`), with the decision's
    bookkeeping as every policy gives it (`policies._decide`)."""

    name = LOOKAHEAD

    def __init__(self, state: RouterState, config: RouterConfig) -> None:
        self.state = state
        self.config = config
        self.chosen: str | None = None

    def choose(self, request: RouteRequest, now: float) -> Decision:
        replica = self.state.replica(self.chosen) if self.chosen is not None else None
        if replica is None:
            return _no_route(request, self.state, self.name)
        return _decide(
            self.state,
            self.config,
            request,
            now,
            replica,
            Reason.CHEAPEST_MEETING_SLO,
            self.name,
            baseline=least_load_pick(self.state, self.config, request, now),
        )


class LookaheadSimulator(ClusterSimulator):
    """The cluster simulator with the lookahead router deciding (colocated fleets only)."""

    def __init__(
        self, fleet: FleetSpec, config: SimConfig | None = None, may_miss: int | None = None
    ) -> None:
        """`may_miss`: stop with `Missed` once more interactive requests than this are
        sure to miss (their first token late, or their decode finished too slowly): an
        overloaded fleet's copies hold its whole backlog, each decision drains them all,
        and the run would take hours to say what its first minute showed."""
        if fleet.disaggregated or (config is not None and config.gateways != 1):
            raise ValueError("the lookahead router runs colocated fleets behind one gateway")
        super().__init__(fleet, config)
        self._may_miss = may_miss
        # Per replica, its requests' fates if it gets no other (`_alone_fates`).
        self._alone: dict[str, dict[str, tuple[int, float]]] = {}

    def _gateway(self, index: int, state: RouterState) -> Gateway:
        # Every routing-table version gets a new gateway (`_republish`): each one a Lookahead.
        return Gateway(index, state, Lookahead(state, self.config.router))

    def _route_request(self, request: SimRequest) -> None:
        policy = self._gateways[0].policy
        assert isinstance(policy, Lookahead)
        policy.chosen = self._choose(request)
        super()._route_request(request)
        if self._may_miss is not None and self._arrivals % CHECK_EVERY == 0:
            missed = self._missed(request.arrival_s)
            if missed > self._may_miss:
                raise Missed(missed)

    def _missed(self, now_s: float) -> int:
        """Interactive requests already sure to miss a clock."""
        tier = self.config.router.slo_tiers["interactive"]
        ttft_s, tpot_s = tier.ttft_s or math.inf, tier.tpot_s or math.inf
        missed = 0
        for record in self._records.values():
            if record.request.tier != "interactive":
                continue
            if record.first_token_s is None:
                missed += now_s - record.request.arrival_s > ttft_s
            elif record.first_token_s - record.request.arrival_s > ttft_s:
                missed += 1
            else:
                tpot = record.tpot_s
                missed += tpot is not None and tpot > tpot_s
        return missed

    def _choose(self, request: SimRequest) -> str | None:
        added = EngineRequest(
            request.request_id,
            request.prompt_tokens,
            request.output_tokens,
            request.arrival_s,
            request.block_hashes,
        )
        best: tuple[int, float] | None = None
        chosen = None
        for replica in self._routable(request.arrival_s):
            engine = replica.engine
            if request.prompt_tokens + request.output_tokens > engine.max_model_len:
                continue
            alone = self._alone_fates(replica)
            still = [fate for rid, fate in alone.items() if engine.progress(rid) is not None]
            with_it = engine.copy()
            with_it.add_request(added)
            fates = self._fates(with_it, request).values()
            key = (
                sum(miss for miss, _ in fates) - sum(miss for miss, _ in still),
                sum(over for _, over in fates) - sum(over for _, over in still),
            )
            if best is None or key < best:
                best, chosen = key, replica.replica_id
        if chosen is not None:
            self._alone.pop(chosen, None)  # its future changes with the request
        return chosen

    def _alone_fates(self, replica: SimReplica) -> dict[str, tuple[int, float]]:
        """The fates of the requests on `replica` if it gets no other. The engine model is
        deterministic, so they hold until it does: one drained copy per request routed
        there, not per decision."""
        fates = self._alone.get(replica.replica_id)
        if fates is None:
            fates = self._alone[replica.replica_id] = self._fates(replica.engine.copy(), None)
        return fates

    def _fates(self, engine: Engine, added: SimRequest | None) -> dict[str, tuple[int, float]]:
        """Drain `engine` (a copy of a replica's, `added` in it or not) and judge every
        request on it by its tier's objectives: request id -> (1 if it misses else 0, the
        sum of its two clocks over their objectives)."""
        first: dict[str, float] = {}
        finished: dict[str, tuple[float, int]] = {}
        for event in engine.advance(math.inf):
            if event.kind == FIRST_TOKEN:
                first.setdefault(event.request_id, event.time_s)
            elif event.kind == FINISHED:
                finished[event.request_id] = (event.time_s, event.output_tokens)
        fates: dict[str, tuple[int, float]] = {}
        for request_id, (ended_s, tokens) in finished.items():
            if added is not None and request_id == added.request_id:
                request, first_token_s = added, first.get(request_id)
            else:
                record = self._records[request_id]
                request, first_token_s = record.request, record.first_token_s
                first_token_s = (
                    first_token_s if first_token_s is not None else first.get(request_id)
                )
            if first_token_s is None:
                continue
            ttft, tpot = self._over(request, first_token_s, ended_s, tokens)
            fates[request_id] = (int(max(ttft, tpot) > 1.0), ttft + tpot)
        return fates

    def _over(
        self, request: SimRequest, first_token_s: float, ended_s: float, tokens: int
    ) -> tuple[float, float]:
        """The request's TTFT and TPOT, each over its tier's objective (TPOT 0 without one)."""
        tier = self.config.router.slo_tiers.get(request.tier)
        ttft_limit = (tier.ttft_s if tier is not None else None) or routing.KEEPS_UP_TTFT_S
        ttft = (first_token_s - request.arrival_s) / ttft_limit
        if tier is None or not tier.tpot_s or tokens < 2:
            return ttft, 0.0
        return ttft, (ended_s - first_token_s) / (tokens - 1) / tier.tpot_s


def run(fleet: FleetSpec, policy: str, router: RouterConfig) -> Summary | None:
    """One fleet's run under `policy`, or under the lookahead router (None: it stopped as
    soon as the fleet was sure to fail)."""
    if policy != LOOKAHEAD:
        return routing.run(fleet, policy, router)
    config = SimConfig(policy="least_load", router=router, telemetry_interval_s=None)
    interactive = sum(1 for r in routing.REQUESTS if r.tier == "interactive")
    may_miss = math.floor((1 - routing.SLO_SHARE) * interactive)
    simulator = LookaheadSimulator(
        replace(fleet, max_num_batched_tokens=routing.ENGINE_BUDGET), config, may_miss
    )
    try:
        return summarize(simulator.run(routing.REQUESTS))
    except Missed:
        return None


def smallest(
    task: tuple[str, str, RouterConfig, int, int | None],
) -> tuple[str, str, int | None, float, float]:
    """(class, policy, fewest replicas meeting the SLO or None, attainment there, seconds):
    `routing.search_size`'s doubling from the lower bound, then bisection."""
    gpu, policy, router, max_size, bound = task
    started = time.perf_counter()

    def attained(summary: Summary | None) -> float:
        return routing.attainment(summary) if summary is not None else 0.0

    failing, size = (bound or 1) - 1, min(bound or 1, max_size)
    meeting, figure = None, 0.0
    while meeting is None and size <= max_size:
        summary = run(homogeneous(gpu, size), policy, router)
        if summary is not None and routing.meets(summary):
            meeting, figure = size, attained(summary)
        else:
            failing, size = size, (min(size * 2, max_size) if size < max_size else size + 1)
    while meeting is not None and meeting - failing > 1:
        middle = (failing + meeting) // 2
        summary = run(homogeneous(gpu, middle), policy, router)
        if summary is not None and routing.meets(summary):
            meeting, figure = middle, attained(summary)
        else:
            failing = middle
    return gpu, policy, meeting, figure, time.perf_counter() - started


def spread_stream(rate: float = 20.0, seconds: float = 60.0) -> list[SimRequest]:
    """Interactive requests evenly spaced, of every prompt from 500 to 6,000 tokens and every
    output from 50 to 400, in a fixed interleaving: nothing shared, so nothing is cached (the
    stream `tests/capacity/test_lower_bound.py` bounds)."""
    count = int(rate * seconds)
    return [
        SimRequest(
            request_id=f"r0-{i}",
            arrival_s=i / rate,
            prompt_tokens=500 + (i * 37) % 5500,
            output_tokens=50 + (i * 53) % 350,
            tenant="acme",
            tier="interactive",
        )
        for i in range(count)
    ]


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="", help="comma-separated families or blends")
    parser.add_argument("--spread", action="store_true", help="add the lower bound's stream")
    parser.add_argument("--gpus", default="L40S-48GB")
    parser.add_argument("--duration", type=routing.positive, default=60.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--policies", default="cost_aware,least_load")
    parser.add_argument("--max-replicas", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    try:
        args.families = parse_families(args.families) if args.families else []
    except FamilyError as error:
        parser.error(str(error))
    if not args.families and not args.spread:
        parser.error("name --families, --spread or both")
    args.gpus = [g for g in args.gpus.split(",") if g]
    args.policies = [p for p in args.policies.split(",") if p]
    return args


def workloads(args: argparse.Namespace) -> list[tuple[str, list[SimRequest]]]:
    found = []
    if args.spread:
        found.append((SPREAD, spread_stream()))
    for name in args.families:
        spec = family(name)
        seed = spec.seed if args.seed is None else args.seed
        found.append((name, spec.generate(seed=seed, duration_s=args.duration)))
    return found


def main() -> int:
    args = parse_arguments()
    router = RouterConfig()
    policies = [*args.policies, LOOKAHEAD]
    print("| workload | class | bound | floor | " + " | ".join(policies) + " |")
    print("|---|---|---|---|" + "---|" * len(policies))
    for name, requests in workloads(args):
        routing.REQUESTS[:] = requests
        bounds = routing.lower_bounds(router, args.gpus)
        floors = routing.sustained_floors(router, args.gpus)
        tasks = [
            (gpu, policy, router, args.max_replicas, bounds[gpu])
            for gpu in args.gpus
            for policy in policies
        ]
        with get_context("fork").Pool(args.workers) as pool:
            results = pool.map(smallest, tasks)
        found = {
            (gpu, policy): (replicas, figure, s) for gpu, policy, replicas, figure, s in results
        }
        for gpu in args.gpus:
            cells = []
            for policy in policies:
                replicas, figure, _ = found[gpu, policy]
                cells.append(f"{replicas} ({figure:.2%})" if replicas else f"none ({figure:.2%})")
            print(
                f"| {name} | {gpu} | {bounds[gpu]} | {floors[gpu]:.2f} | "
                + " | ".join(cells)
                + " |",
                flush=True,
            )
        slowest = max(s for _, _, s in found.values())
        print(f"  ({len(requests)} requests; slowest search {slowest:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
