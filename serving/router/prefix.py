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
        """Replica id -> number of leading blocks of `hashes` it holds (only non-zero ones)."""
        blocks = self._blocks
        matched: dict[str, int] = {}
        for position, block_hash in enumerate(hashes):
            holders = blocks.get((tenant, block_hash))
            if not holders:
                break
            extended = False
            for replica_id in holders:
                # Contiguity: an evicted middle block ends that replica's prefix.
                if matched.get(replica_id, 0) == position:
                    matched[replica_id] = position + 1
                    extended = True
            if not extended:
                break
        return matched

    def record(self, tenant: str, hashes: Sequence[int], replica_id: str) -> None:
        blocks = self._blocks
        for block_hash in hashes:
            key = (tenant, block_hash)
            holders = blocks.get(key)
            if holders is None:
                blocks[key] = {replica_id: None}
                if len(blocks) > self._capacity:
                    blocks.popitem(last=False)
                continue
            blocks.move_to_end(key)
            holders.pop(replica_id, None)
            holders[replica_id] = None
            if len(holders) > self._replicas_per_block:
                del holders[next(iter(holders))]
