"""llm-d's endpoint picker (EPP) with its default scheduling profile, as shipped.

Sources read (kubernetes-sigs/gateway-api-inference-extension, the EPP llm-d deploys):

- `config/charts/inferencepool/templates/epp-config.yaml`, `default-plugins.yaml`: the
  default profile is `queue-scorer` weight 2, `kv-cache-utilization-scorer` weight 2,
  `prefix-cache-scorer` weight 3 (llm-d's inference-scheduling guide ships the same three
  weights). No picker is named, so the profile gets the default max-score picker.
- `pkg/epp/scheduling/framework/plugins/scorer/queue.go`, `QueueScorer.Score`: min-max over
  the candidates' `WaitingQueueSize`, `(max - q) / (max - min)`, 1.0 for all when equal.
- `pkg/epp/scheduling/framework/plugins/scorer/kvcache_utilization.go`,
  `KVCacheUtilizationScorer.Score`: `1 - KVCacheUsagePercent`.
- `pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go`: `DefaultHashBlockSize` 64
  characters (~16 tokens, vLLM's block), `DefaultMaxPrefixBlocks` 256,
  `DefaultLRUCapacityPerServer` 31250; `hashPrompt` makes block 0 the model name's hash and
  chains each block on the previous; `matchLongestPrefix` walks blocks from the first,
  stops at the first block no server holds, and counts for each server the blocks it holds
  on the way; `Score` is that count over the number of hashes; `PreRequest` adds the
  request's hashes to the chosen endpoint's entry at once (no wait for any telemetry).
- `pkg/epp/scheduling/framework/plugins/multi/prefix/indexer.go`: one LRU per server
  (`podToLRU`, hashicorp golang-lru, blocks added in prompt order) and a `hashToPods`
  map that eviction keeps in step.
- `pkg/epp/scheduling/framework/plugins/picker/max_score_picker.go`, `MaxScorePicker.Pick`:
  shuffle, stable sort by score, take the first: the highest score, ties at random.
- `pkg/epp/server/runserver.go`, `DefaultRefreshMetricsInterval` = 50 ms: how often the
  EPP scrapes each endpoint's queue and KV use.

The default profile counts nothing in flight: the queue and KV scorers read only the
scraped metrics, which is why their 50 ms refresh matters (llm-d's `active-request` and
`load-aware` scorers exist but are not in the default profile).

Simplified: the EPP hashes 64-character chunks of the prompt text; the request here carries
16-token block hashes (tenant-salted), taken one for one. The index is keyed by tenant as
well, so no tenant's blocks count for another. The refresh interval is the simulator's to
honour (`refresh_interval_s`): this class reads whatever telemetry `RouterState` holds.
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

QUEUE_WEIGHT = 2.0
KV_CACHE_WEIGHT = 2.0
PREFIX_WEIGHT = 3.0
MAX_PREFIX_BLOCKS = 256
LRU_CAPACITY_PER_SERVER = 31_250

# A block key: (tenant, block hash); block 0 is (tenant, model name).
BlockKey = tuple[str, int | str]


class EppPrefixIndexer:
    """`indexer.go`: an LRU of block keys per server, and which servers hold each key."""

    def __init__(self, capacity_per_server: int = LRU_CAPACITY_PER_SERVER) -> None:
        self.capacity = capacity_per_server
        self._lru: dict[str, OrderedDict[BlockKey, None]] = {}
        self._holders: dict[BlockKey, set[str]] = {}

    def add(self, keys: Sequence[BlockKey], server: str) -> None:
        lru = self._lru.get(server)
        if lru is None:
            lru = self._lru[server] = OrderedDict()
        holders = self._holders
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                holders.setdefault(key, set()).add(server)
                if len(lru) > self.capacity:
                    evicted, _ = lru.popitem(last=False)
                    pods = holders[evicted]
                    pods.discard(server)
                    if not pods:
                        del holders[evicted]

    def match(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """`matchLongestPrefix`: per server, the blocks it holds up to the first block that
        no server holds."""
        counts: dict[str, int] = {}
        holders = self._holders
        for key in keys:
            servers = holders.get(key)
            if not servers:
                break
            for server in servers:
                counts[server] = counts.get(server, 0) + 1
        return counts


def block_keys(request: RouteRequest) -> list[BlockKey]:
    """`hashPrompt`: the model's block, then the prompt's blocks up to the cap; none at all
    for a prompt shorter than one block."""
    if not request.prefix_hashes:
        return []
    tenant = request.tenant
    keys: list[BlockKey] = [(tenant, request.model)]
    keys.extend((tenant, h) for h in request.prefix_hashes[:MAX_PREFIX_BLOCKS])
    return keys


def epp_scores(
    candidates: Sequence[ReplicaState], matches: dict[str, int], total_blocks: int
) -> list[float]:
    """The default profile's weighted sum per candidate, in the candidates' order."""
    queues = [replica.waiting for replica in candidates]
    shortest, longest = min(queues), max(queues)
    spread = longest - shortest
    scores = []
    for replica, waiting in zip(candidates, queues, strict=True):
        queue = 1.0 if spread == 0 else (longest - waiting) / spread
        kv_cache = 1.0 - replica.kv_usage
        prefix = matches.get(replica.replica_id, 0) / total_blocks if total_blocks else 0.0
        scores.append(QUEUE_WEIGHT * queue + KV_CACHE_WEIGHT * kv_cache + PREFIX_WEIGHT * prefix)
    return scores


class LlmDEpp:
    """llm-d's EPP default profile: queue 2, KV utilisation 2, approximate prefix 3, max
    score with a random tie-break. See the module docstring for the sources."""

    name = "llm_d_epp"
    refresh_interval_s: float | None = 0.050

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()
        self.indexer = carried(state, self.name, EppPrefixIndexer)

    def choose(self, request: RouteRequest, now: float) -> Decision:
        state = self.state
        route = state.route(request.model)
        if route is None:
            return _no_route(request, state, self.name)
        keys = block_keys(request)
        matches = self.indexer.match(keys) if keys else {}
        for position, version in enumerate(versions_in_order(route, request)):
            candidates = _candidates(live_replicas(state, version), request, now, self.config)
            if not candidates:
                continue
            scores = epp_scores(candidates, matches, len(keys))
            best = max(scores)
            tied = [r for r, s in zip(candidates, scores, strict=True) if s == best]
            chosen = tied[0] if len(tied) == 1 else state.rng.choice(tied)
            self.indexer.add(keys, chosen.replica_id)  # PreRequest
            # The model's block is no prompt token; the rest is what the EPP expects cached.
            cached = min(len(request.prefix_hashes), max(0, matches.get(chosen.replica_id, 0) - 1))
            split = version if position == 0 else None
            return _decide(
                state,
                self.config,
                request,
                now,
                chosen,
                Reason.SCORED,
                self.name,
                cached,
                baseline=least_load_pick(state, self.config, request, now, split=split),
            )
        return _no_route(request, state, self.name)
