"""Dynamo's KV router: its default worker selector over its own active-block accounting.

Sources read (ai-dynamo/dynamo):

- `lib/llm/src/kv_router/scheduler.rs`, `DefaultWorkerSelector::select_worker`: per worker,
  `logit = overlap_score_weight * potential_prefill_blocks + decode_blocks`, lower is
  better, where `potential_prefill_blocks = prefill_tokens / block_size` and
  `decode_blocks` comes from the router's active-sequence accounting; `softmax_sample` at
  temperature 0 returns every worker with the smallest logit, and a tie goes to the worker
  with the smallest tree size (`overlaps.tree_sizes`), then HashMap order.
- `lib/llm/src/kv_router/config.rs` (`KvRouterConfig::default`): `overlap_score_weight`
  1.0, `router_temperature` 0.0, `use_kv_events` true, `router_track_active_blocks` true,
  `router_track_output_blocks` false, `router_ttl_secs` 120, `router_max_tree_size` 2**20,
  `router_prune_target_ratio` 0.8.
- `lib/llm/src/kv_router/sequence.rs`, `ActiveSequences::potential_blocks_and_tokens`:
  `potential_tokens = new_tokens(isl, overlap) + active_tokens` with `new_tokens = isl -
  overlap * block_size` and `active_tokens` the prompt tokens of requests routed there and
  not yet prefilled (`mark_prefill_completed` removes them); `potential_blocks =
  new_blocks(seq) + active_blocks()`, the unique blocks of the requests in flight there
  plus the request's blocks not among them. The router keeps these from what it routed,
  not from scraped metrics.
- `lib/llm/src/kv_router/approx.rs`, `ApproxKvIndexer`: without KV events, the radix tree
  is fed by the routing decisions themselves (each routed request's blocks stored for the
  chosen worker), every block expiring `router_ttl_secs` after it was last routed, the tree
  pruned to `router_prune_target_ratio` of `router_max_tree_size` when it grows past it.
  The overlap is the run of leading blocks the worker holds (`RadixTree::find_matches`).

Modelled: the cost, the argmin at temperature 0 and its tree-size tie-break (then a random
pick), and the approximate radix tree (`approx.rs`), since the router here sees no engine KV
events. Simplified: Dynamo's default `use_kv_events` tree follows the engines' own caches,
which the approximate tree only estimates; `active_tokens` and `active_blocks` are read
from `RouterState`'s exact in-flight counts (`prefill_pending_tokens`, and the prompt
tokens of requests in flight less what was expected cached, `inflight_prompt_tokens`, over
the block size) rather than from per-request block sets, so a prefix shared by requests in
flight counts about once, as Dynamo's unique blocks do, but not exactly. Temperatures above
0 (softmax sampling) are not modelled.

Dynamo's cost reads no polled metrics (its accounting is its own and its KV index is
pushed), so `refresh_interval_s` is None: telemetry matters to it only for the hard
filters (health, telemetry age).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from serving.router.canary import versions_in_order
from serving.router.contracts import Decision, Reason, ReplicaState, RouterConfig, RouteRequest
from serving.router.index import RouterState
from serving.router.peers._carry import carried
from serving.router.peers._pool import live_replicas
from serving.router.policies import _candidates, _decide, _no_route, least_load_pick

OVERLAP_SCORE_WEIGHT = 1.0
ROUTER_TTL_S = 120.0
MAX_TREE_SIZE = 1 << 20
PRUNE_TARGET_RATIO = 0.8

BlockKey = tuple[str, int]


class ApproxKvIndexer:
    """`approx.rs`: blocks routed to each worker, each forgotten `ttl_s` after it was last
    routed there, or earlier (oldest first) when the tree outgrows `max_tree_size`."""

    def __init__(
        self,
        ttl_s: float = ROUTER_TTL_S,
        max_tree_size: int = MAX_TREE_SIZE,
        prune_target_ratio: float = PRUNE_TARGET_RATIO,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_tree_size = max_tree_size
        self.prune_target = int(max_tree_size * prune_target_ratio)
        # (block, worker) -> expiry; the TTL is one constant, so insertion order (refreshes
        # moved to the end) is expiry order.
        self._expiry: OrderedDict[tuple[BlockKey, str], float] = OrderedDict()
        self._holders: dict[BlockKey, set[str]] = {}
        self.tree_sizes: dict[str, int] = {}

    def route(self, blocks: Sequence[BlockKey], worker: str, now: float) -> None:
        expiry = now + self.ttl_s
        entries = self._expiry
        for block in blocks:
            entry = (block, worker)
            if entry in entries:
                entries.move_to_end(entry)
            else:
                self._holders.setdefault(block, set()).add(worker)
                self.tree_sizes[worker] = self.tree_sizes.get(worker, 0) + 1
            entries[entry] = expiry
        if len(entries) > self.max_tree_size:
            while len(entries) > self.prune_target:
                self._forget(*entries.popitem(last=False)[0])

    def overlaps(self, blocks: Sequence[BlockKey], now: float) -> dict[str, int]:
        """Per worker, the leading blocks of `blocks` it holds."""
        self._expire(now)
        scores: dict[str, int] = {}
        matching: set[str] | None = None
        for depth, block in enumerate(blocks, start=1):
            holders = self._holders.get(block)
            if not holders:
                break
            matching = set(holders) if matching is None else matching & holders
            if not matching:
                break
            for worker in matching:
                scores[worker] = depth
        return scores

    def _expire(self, now: float) -> None:
        entries = self._expiry
        while entries:
            entry, expiry = next(iter(entries.items()))
            if expiry > now:
                return
            del entries[entry]
            self._forget(*entry)

    def _forget(self, block: BlockKey, worker: str) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block]
        self.tree_sizes[worker] -= 1


def dynamo_logit(
    replica: ReplicaState,
    isl: int,
    request_blocks: int,
    overlap: int,
    block_size: int,
    overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
) -> float:
    """`DefaultWorkerSelector`'s cost of sending the request to `replica` (lower wins)."""
    new_tokens = max(0, isl - overlap * block_size)
    prefill_tokens = replica.prefill_pending_tokens + new_tokens
    active_blocks = replica.inflight_prompt_tokens / block_size
    decode_blocks = active_blocks + max(0, request_blocks - overlap)
    return overlap_score_weight * prefill_tokens / block_size + decode_blocks


class DynamoKv:
    """Dynamo's KV router at its defaults: argmin of overlap-weighted prefill blocks plus
    active decode blocks. See the module docstring for the sources."""

    name = "dynamo_kv"
    refresh_interval_s: float | None = None

    def __init__(
        self,
        state: RouterState,
        config: RouterConfig | None = None,
        overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
    ) -> None:
        self.state = state
        self.config = config or RouterConfig()
        self.overlap_score_weight = overlap_score_weight
        self.indexer = carried(state, self.name, ApproxKvIndexer)

    def choose(self, request: RouteRequest, now: float) -> Decision:
        state = self.state
        route = state.route(request.model)
        if route is None:
            return _no_route(request, state, self.name)
        blocks = [(request.tenant, h) for h in request.prefix_hashes]
        overlaps = self.indexer.overlaps(blocks, now) if blocks else {}
        block_size = self.config.prefix_block_tokens
        for position, version in enumerate(versions_in_order(route, request)):
            candidates = _candidates(live_replicas(state, version), request, now, self.config)
            if not candidates:
                continue
            chosen = self._select(candidates, request, overlaps, block_size)
            if blocks:
                self.indexer.route(blocks, chosen.replica_id, now)
            overlap = overlaps.get(chosen.replica_id, 0)
            split = version if position == 0 else None
            return _decide(
                state,
                self.config,
                request,
                now,
                chosen,
                Reason.PREFIX_AFFINITY if overlap else Reason.SCORED,
                self.name,
                overlap,
                baseline=least_load_pick(state, self.config, request, now, split=split),
            )
        return _no_route(request, state, self.name)

    def _select(
        self,
        candidates: list[ReplicaState],
        request: RouteRequest,
        overlaps: dict[str, int],
        block_size: int,
    ) -> ReplicaState:
        isl, request_blocks = request.prompt_tokens, len(request.prefix_hashes)
        weight = self.overlap_score_weight
        best: list[ReplicaState] = []
        best_logit = 0.0
        for replica in candidates:
            overlap = overlaps.get(replica.replica_id, 0)
            logit = dynamo_logit(replica, isl, request_blocks, overlap, block_size, weight)
            if not best or logit < best_logit:
                best, best_logit = [replica], logit
            elif logit == best_logit:
                best.append(replica)
        if len(best) == 1:
            return best[0]
        sizes = self.indexer.tree_sizes
        smallest = min(sizes.get(r.replica_id, 0) for r in best)
        best = [r for r in best if sizes.get(r.replica_id, 0) == smallest]
        return best[0] if len(best) == 1 else self.state.rng.choice(best)
