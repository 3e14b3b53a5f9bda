"""vLLM production-stack's router: its default routing logic and its prefix-aware one.

Sources read (vllm-project/production-stack):

- `src/vllm_router/routers/routing_logic.py`: `RoutingLogic` ships `roundrobin`,
  `session`, `kvaware`, `prefixaware`, `disaggregated_prefill` and `priority`.
  `RoundRobinRouter.route_request` sorts the endpoints by URL and takes
  `sorted_endpoints[req_id % len]`, one counter for every request. `PrefixAwareRouter.
  route_request` takes `hashtrie.longest_prefix_match(prompt, available_endpoints)`, picks
  `random.choice` among the endpoints it returns, then `hashtrie.insert(prompt, chosen)`:
  no load signal at all.
- `src/vllm_router/prefix/hashtrie.py`, `HashTrie`: the prompt cut into `chunk_size` = 128
  character chunks, each xxhash'd, as a trie whose nodes hold the endpoints sent that
  prefix; `longest_prefix_match` walks the chunks, narrowing the endpoint set to those at
  each node, and stops where the next node has none of them (so with no match at all, every
  available endpoint is returned); `insert` adds the endpoint to every node on the path.
  The docstring: "we assume that there is no eviction of prefix cache". (`prefix/config.py`,
  `HashTrieConfig`, sets up memory-bound eviction at 2 GB, far beyond a simulated run.)
- `src/vllm_router/parsers/parser.py`: `--routing-logic` has no default; the Helm chart
  (`helm/values.yaml`, `routerSpec.routingLogic`) defaults to `roundrobin`, which is
  modelled as the project's default. `--engine-stats-interval` defaults to 30 s, the chart's
  `routerSpec.engineScrapeInterval` to 15 s; neither routing logic reads engine stats (the
  `session` logic's fallback reads request QPS, not modelled).

Simplified: 128 characters are about 32 tokens, two of the request's 16-token block hashes,
so a chunk is two blocks (the chained hash of its last block names the whole prefix) and an
odd last block stands for the trailing partial chunk. Keys carry the tenant, so no tenant's
prefix is another's hit. The `session` and `kvaware` logics (the latter asks LMCache's
controller where the KV is) are not modelled.
"""

from __future__ import annotations

from serving.router.canary import versions_in_order
from serving.router.contracts import Decision, Reason, RouterConfig, RouteRequest
from serving.router.index import RouterState
from serving.router.peers._carry import carried
from serving.router.peers._pool import live_replicas
from serving.router.policies import _candidates, _decide, _no_route, least_load_pick

# HashTrie's 128-character chunk over 16-token (~64-character) blocks.
BLOCKS_PER_CHUNK = 2
# Chart default for `--engine-stats-interval` (helm/values.yaml engineScrapeInterval).
ENGINE_SCRAPE_INTERVAL_S = 15.0

ChunkKey = tuple[str, int]


class _Counter:
    """`RoundRobinRouter.req_id`: the router is a process-wide singleton."""

    def __init__(self) -> None:
        self.value = 0


class ProductionStackRoundRobin:
    """production-stack's default `roundrobin`: endpoints sorted by URL, one counter."""

    name = "production_stack_roundrobin"
    refresh_interval_s: float | None = ENGINE_SCRAPE_INTERVAL_S

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()
        self.counter = carried(state, self.name, _Counter)

    def choose(self, request: RouteRequest, now: float) -> Decision:
        state = self.state
        route = state.route(request.model)
        if route is None:
            return _no_route(request, state, self.name)
        for position, version in enumerate(versions_in_order(route, request)):
            endpoints = _candidates(live_replicas(state, version), request, now, self.config)
            if not endpoints:
                continue
            endpoints.sort(key=lambda replica: replica.replica_id)
            chosen = endpoints[self.counter.value % len(endpoints)]
            self.counter.value += 1
            split = version if position == 0 else None
            return _decide(
                state,
                self.config,
                request,
                now,
                chosen,
                Reason.ROUND_ROBIN,
                self.name,
                baseline=least_load_pick(state, self.config, request, now, split=split),
            )
        return _no_route(request, state, self.name)


class HashTrie:
    """`hashtrie.py`'s trie, one node per chunked prefix (a chained hash names a path)."""

    def __init__(self) -> None:
        self._endpoints: dict[ChunkKey, set[str]] = {}

    def longest_prefix_match(
        self, chunks: list[ChunkKey], available: set[str]
    ) -> tuple[int, set[str]]:
        """Chunks matched and the available endpoints holding all of them."""
        selected = available
        matched = 0
        for chunk in chunks:
            holders = self._endpoints.get(chunk)
            if holders is None:
                break
            narrowed = holders & selected
            if not narrowed:
                break
            matched += 1
            selected = narrowed
        return matched, selected

    def insert(self, chunks: list[ChunkKey], endpoint: str) -> None:
        for chunk in chunks:
            self._endpoints.setdefault(chunk, set()).add(endpoint)


def prompt_chunks(request: RouteRequest) -> list[ChunkKey]:
    hashes = request.prefix_hashes
    last = BLOCKS_PER_CHUNK - 1
    chunks = [(request.tenant, hashes[i]) for i in range(last, len(hashes), BLOCKS_PER_CHUNK)]
    if len(hashes) % BLOCKS_PER_CHUNK:
        chunks.append((request.tenant, hashes[-1]))  # the trailing partial chunk
    return chunks


class ProductionStackPrefixAware:
    """production-stack's `prefixaware`: the longest trie match, a random endpoint among
    those holding it (any endpoint when none does), no load signal."""

    name = "production_stack_prefix"
    refresh_interval_s: float | None = ENGINE_SCRAPE_INTERVAL_S

    def __init__(self, state: RouterState, config: RouterConfig | None = None) -> None:
        self.state = state
        self.config = config or RouterConfig()
        self.trie = carried(state, self.name, HashTrie)

    def choose(self, request: RouteRequest, now: float) -> Decision:
        state = self.state
        route = state.route(request.model)
        if route is None:
            return _no_route(request, state, self.name)
        chunks = prompt_chunks(request)
        for position, version in enumerate(versions_in_order(route, request)):
            endpoints = _candidates(live_replicas(state, version), request, now, self.config)
            if not endpoints:
                continue
            by_id = {replica.replica_id: replica for replica in endpoints}
            matched, holders = self.trie.longest_prefix_match(chunks, set(by_id))
            chosen = by_id[state.rng.choice(sorted(holders))]
            self.trie.insert(chunks, chosen.replica_id)
            cached = min(len(request.prefix_hashes), matched * BLOCKS_PER_CHUNK)
            split = version if position == 0 else None
            return _decide(
                state,
                self.config,
                request,
                now,
                chosen,
                Reason.PREFIX_AFFINITY if matched else Reason.SCORED,
                self.name,
                cached,
                baseline=least_load_pick(state, self.config, request, now, split=split),
            )
        return _no_route(request, state, self.name)
