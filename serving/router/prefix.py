"""An approximate, router-side index of which replica holds which prompt prefix.

Like llm-d's approximate prefix-cache scorer: we never ask the engines what they cache;
we remember where we sent each prefix and assume it is still there while the replica's KV
could still hold it (`PrefixIndex.hold_at_most`). Entries are keyed by
(tenant, block hash): the caller already salts hashes per tenant, and keying by tenant as
well means even a hash collision or a caller that forgot the salt cannot turn one
tenant's cached prompt into another tenant's hit (a timing side channel).

The index is written on every routed request and lives for the router's lifetime, so it
is built to allocate nothing the garbage collector tracks: a tuple key and a holders dict
per new block used to trigger a young-generation collection every ~140 decisions, most
of the router's p99. A (tenant, block hash) pair is one int, `block_hash << 32 | tenant
number` (injective for any int hash, as the tenant number stays below 2**32), and a
block's holders are one string, each replica id closed by a separator: `"\x1fa\x1fb\x1f"`
holds a then b. Strings are not tracked, and a block costs one dict entry whatever its
holders: recording a prompt touches each of its blocks once, where a dict per holder slot
cost a lookup per slot and made `record` most of the decision (6 us at 16 blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

TENANT_BITS = 32
TENANT_MASK = (1 << TENANT_BITS) - 1
SEPARATOR = "\x1f"  # ASCII unit separator; a replica id holding one is refused


class PrefixIndex:
    """At most `capacity_blocks` (tenant, block) entries, least recently recorded evicted
    first; each remembers the last `replicas_per_block` distinct replicas it was sent to
    (a new replica beyond that pushes out the one that got the block first).

    A replica whose KV capacity is known (`hold_at_most`) also forgets, least recently
    recorded there first, the blocks beyond what its KV holds. vLLM keeps every computed
    block's hash until the block is reused, and reuses the least recently used free block
    first (`FreeKVCacheBlockQueue`, vllm/v1/core/kv_cache_utils.py): a replica's prefix
    cache is about the last KV capacity's worth of blocks written there. Without this a
    busy replica is credited with conversations it evicted long ago, and its TTFT is
    predicted as if their prompts were cached. llm-d's approximate prefix scorer bounds
    each server's LRU the same way, at a fixed 31,250 blocks (`lruCapacityPerServer`).
    """

    def __init__(
        self, capacity_blocks: int = 200_000, replicas_per_block: int = 4, block_tokens: int = 16
    ) -> None:
        if capacity_blocks <= 0 or replicas_per_block <= 0 or block_tokens <= 0:
            raise ValueError(
                "PrefixIndex needs a positive capacity, replicas per block and block size"
            )
        self._capacity = capacity_blocks
        self._replicas_per_block = replicas_per_block
        # Tokens a hashed block stands for: `prompt_block_hashes`' block size, which
        # `RouterConfig.prefix_block_tokens` also counts cached tokens in.
        self._block_tokens = block_tokens
        # Per replica with a known KV capacity (`hold_at_most`): its blocks, least recently
        # recorded first, and how many it holds at most.
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._held_at_most: dict[str, int] = {}
        # Tenants are few and long-lived; numbering them keeps keys plain ints. The table
        # grows only with new tenants (a tenant whose blocks all aged out keeps its number).
        self._tenant_numbers: dict[str, int] = {}
        # LRU over blocks -> the block's holders, oldest first, each closed by SEPARATOR
        # and the first opened by one: SEPARATOR + id + SEPARATOR is then a substring of
        # the holders exactly when id is one of them (ids hold no separator).
        self._blocks: OrderedDict[int, str] = OrderedDict()
        # What a peer policy keeps beside the index, carried over with it (peers/_carry.py).
        self.carried: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def hold_at_most(self, replica_id: str, kv_tokens: int) -> None:
        """The replica's KV capacity in tokens: it is credited with at most that many of
        the prompt tokens recorded there, the most recent."""
        self._held_at_most[replica_id] = max(1, kv_tokens // self._block_tokens)
        self._held.setdefault(replica_id, OrderedDict())

    def longest_matches(self, tenant: str, hashes: Sequence[int]) -> dict[str, int]:
        """Replicas holding the longest recorded run of leading blocks -> its length,
        oldest holder first.

        `record` refreshes a prompt's blocks last to first, so a prompt's earlier blocks
        are always fresher than its later ones and the LRU evicts from the tail: if block
        i is held, so are blocks 0..i. That makes "held" monotone along the prompt, and a
        binary search finds the longest held block in log2(blocks) lookups, as llm-d's
        prefix scorer notes it could. Replicas with only a shorter run are not reported
        (`run_on` finds a replica's own): the longest match is the one worth routing to.
        """
        tenant_number = self._tenant_numbers.get(tenant)
        if tenant_number is None:  # never recorded, so nothing to match (and no number spent)
            return {}
        blocks = self._blocks
        held = _leading_run(blocks, hashes, tenant_number, 0)
        if held == 0:
            return {}
        holders = blocks[hashes[held - 1] << TENANT_BITS | tenant_number]
        matches: dict[str, int] = {}
        start = 1
        end = holders.find(SEPARATOR, start)
        while end >= 0:  # no list from split: a list is tracked by the collector
            matches[holders[start:end]] = held
            start = end + 1
            end = holders.find(SEPARATOR, start)
        return matches

    def first_key(self, tenant: str, hashes: Sequence[int]) -> int | None:
        """The index's key of the prompt's first block under the tenant, for `run_on`; None
        when the tenant has recorded nothing or the prompt has no blocks."""
        tenant_number = self._tenant_numbers.get(tenant)
        if tenant_number is None or not hashes:
            return None
        return hashes[0] << TENANT_BITS | tenant_number

    def run_on(self, replica_id: str, first_key: int, hashes: Sequence[int]) -> int:
        """The leading blocks of `hashes` the replica itself holds, by its own record
        (`hold_at_most`; 0 for a replica without one); `first_key` is `first_key`'s for
        the same tenant and hashes, computed once for every replica asked.

        `longest_matches` reports only the holders of the longest run, and each block
        remembers only its last `replicas_per_block` holders: a replica holding a tenant's
        popular repository but not this session's file is in neither. Its own record is a
        prefix too (it refreshes a prompt's blocks last to first and forgets the least
        recent first), so the same binary search (`_leading_run`) finds its run. Two
        lookups when it does not hold the first block, the common case.
        """
        held = self._held.get(replica_id)
        if held is None or first_key not in held:
            return 0
        # The key's low bits are the tenant's number (see the module doc).
        return _leading_run(held, hashes, first_key & TENANT_MASK, 1)

    def record(self, tenant: str, hashes: Sequence[int], replica_id: str) -> None:
        if SEPARATOR in replica_id:
            raise ValueError(f"a replica id may not hold {SEPARATOR!r}: {replica_id!r}")
        tenant_number = self._tenant_numbers.get(tenant)
        if tenant_number is None:
            tenant_number = self._number_tenant(tenant)
        blocks = self._blocks
        alone = SEPARATOR + replica_id + SEPARATOR  # one string shared by every new block
        appended = replica_id + SEPARATOR
        full = self._replicas_per_block + 1  # separators in a full block's holders
        held = self._held.get(replica_id)  # None: no known KV capacity
        # Last to first: see longest_matches for why earlier blocks must end up fresher.
        # A replica's own blocks are refreshed in the same order, so it forgets a prompt's
        # later blocks before its earlier ones, and what it holds stays a prefix.
        for block_hash in reversed(hashes):
            key = block_hash << TENANT_BITS | tenant_number
            if held is not None:
                if key in held:
                    held.move_to_end(key)
                else:
                    held[key] = None
            holders = blocks.get(key)
            if holders is None:
                blocks[key] = alone
                if len(blocks) > self._capacity:
                    self._forget(*blocks.popitem(last=False))
                continue
            if alone not in holders:
                if holders.count(SEPARATOR) >= full:  # drop the oldest holder
                    holders = holders[holders.index(SEPARATOR, 1) :]
                # Assigning to an existing OrderedDict key keeps its place; moved below.
                blocks[key] = holders + appended
            blocks.move_to_end(key)
        if held is not None:
            at_most = self._held_at_most[replica_id]
            while len(held) > at_most:
                self._evict(held.popitem(last=False)[0], alone)

    def _forget(self, key: int, holders: str) -> None:
        """A block the index no longer holds leaves its holders' own records too."""
        if not self._held:
            return
        start = 1
        end = holders.find(SEPARATOR, start)
        while end >= 0:
            held = self._held.get(holders[start:end])
            if held is not None:
                held.pop(key, None)
            start = end + 1
            end = holders.find(SEPARATOR, start)

    def _evict(self, key: int, alone: str) -> None:
        """The replica (`alone`: its id between separators) no longer holds the block."""
        blocks = self._blocks
        holders = blocks.get(key)
        if holders is None:
            return
        if holders == alone:
            del blocks[key]
        elif alone in holders:
            # Assigning to an existing OrderedDict key keeps its place.
            blocks[key] = holders.replace(alone, SEPARATOR, 1)

    def _number_tenant(self, tenant: str) -> int:
        number = len(self._tenant_numbers)
        if number >= 1 << TENANT_BITS:
            raise OverflowError(f"PrefixIndex numbers at most 2**{TENANT_BITS} tenants")
        self._tenant_numbers[tenant] = number
        return number


def _leading_run(
    present: Container[int], hashes: Sequence[int], tenant_number: int, known: int
) -> int:
    """How many leading blocks of `hashes` (keyed under the tenant's number) are in
    `present`, the first `known` of them known to be, where holding a block means holding
    every one before it (`PrefixIndex.longest_matches`): log2(blocks) lookups."""
    held, unknown = known, len(hashes)  # hashes[:held] are in; hashes[unknown:] are not
    while held < unknown:
        middle = (held + unknown + 1) // 2
        if (hashes[middle - 1] << TENANT_BITS | tenant_number) in present:
            held = middle
        else:
            unknown = middle - 1
    return held
