"""An approximate, router-side index of which replica holds which prompt prefix.

Like llm-d's approximate prefix-cache scorer: we never ask the engines what they cache;
we remember where we sent each prefix and assume it is still there. Entries are keyed by
(tenant, block hash): the caller already salts hashes per tenant, and keying by tenant as
well means even a hash collision or a caller that forgot the salt cannot turn one
tenant's cached prompt into another tenant's hit (a timing side channel).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, capacity_blocks: int = 200_000, replicas_per_block: int = 4) -> None:
        if capacity_blocks <= 0 or replicas_per_block <= 0:
            raise ValueError("PrefixIndex needs a positive capacity and replicas per block")
        self._capacity = capacity_blocks
        self._replicas_per_block = replicas_per_block
        # LRU over blocks; each block remembers the replicas it was last sent to, oldest first.
        self._blocks: OrderedDict[tuple[str, int], dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def longest_matches(self, tenant: str, hashes: Sequence[int]) -> dict[str, int]:
        """Replicas holding the longest recorded run of leading blocks -> its length.

        `record` refreshes a prompt's blocks last to first, so a prompt's earlier blocks
        are always fresher than its later ones and the LRU evicts from the tail: if block
        i is held, so are blocks 0..i. That makes "held" monotone along the prompt, and a
        binary search finds the longest held block in log2(blocks) lookups, as llm-d's
        prefix scorer notes it could. Replicas with only a shorter run are not reported;
        the longest match is the one worth routing to.
        """
        blocks = self._blocks
        held, unknown = 0, len(hashes)  # blocks[:held] are held; blocks[unknown:] are not
        while held < unknown:
            middle = (held + unknown + 1) // 2
            if blocks.get((tenant, hashes[middle - 1])):
                held = middle
            else:
                unknown = middle - 1
        if held == 0:
            return {}
        return dict.fromkeys(blocks[(tenant, hashes[held - 1])], held)

    def record(self, tenant: str, hashes: Sequence[int], replica_id: str) -> None:
        blocks = self._blocks
        # Last to first: see longest_matches for why earlier blocks must end up fresher.
        for block_hash in reversed(hashes):
            key = (tenant, block_hash)
            holders = blocks.get(key)
            if holders is None:
                blocks[key] = {replica_id: None}
                if len(blocks) > self._capacity:
                    blocks.popitem(last=False)
                continue
            blocks.move_to_end(key)
            if replica_id in holders:
                continue
            holders[replica_id] = None
            if len(holders) > self._replicas_per_block:
                del holders[next(iter(holders))]
