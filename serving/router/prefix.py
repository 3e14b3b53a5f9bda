"""An approximate, router-side index of which replica holds which prompt prefix.

Like llm-d's approximate prefix-cache scorer: we never ask the engines what they cache;
we remember where we sent each prefix and assume it is still there. Entries are keyed by
(tenant, block hash): the caller already salts hashes per tenant, and keying by tenant as
well means even a hash collision or a caller that forgot the salt cannot turn one
tenant's cached prompt into another tenant's hit (a timing side channel).

The index is written on every routed request and lives for the router's lifetime, so it
is built to allocate nothing the garbage collector tracks: a tuple key and a holders dict
per new block used to trigger a young-generation collection every ~140 decisions, most
of the router's p99. A (tenant, block hash) pair is one int, `block_hash << 32 | tenant
number` (injective for any int hash, as the tenant number stays below 2**32), and a
block's holders live in plain string values of int-keyed dicts, one dict per holder slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise

TENANT_BITS = 32


class PrefixIndex:
    """At most `capacity_blocks` (tenant, block) entries, least recently recorded evicted
    first; each remembers the last `replicas_per_block` distinct replicas it was sent to
    (a new replica beyond that pushes out the one that got the block first)."""

    def __init__(self, capacity_blocks: int = 200_000, replicas_per_block: int = 4) -> None:
        if capacity_blocks <= 0 or replicas_per_block <= 0:
            raise ValueError("PrefixIndex needs a positive capacity and replicas per block")
        self._capacity = capacity_blocks
        # Tenants are few and long-lived; numbering them keeps keys plain ints. The table
        # grows only with new tenants (a tenant whose blocks all aged out keeps its number).
        self._tenant_numbers: dict[str, int] = {}
        # LRU over blocks -> the block's first (oldest) holder.
        self._blocks: OrderedDict[int, str] = OrderedDict()
        # _later[i][key] is the block's (i + 2)-th holder in arrival order; a key is in
        # _later[i] only if it is in _later[i - 1], so a block's holders are contiguous.
        # Most blocks have one holder and appear in none of these.
        self._later: tuple[dict[int, str], ...] = tuple({} for _ in range(replicas_per_block - 1))
        # What a peer policy keeps beside the index, carried over with it (peers/_carry.py).
        self.carried: dict[str, object] = {}

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
        tenant_number = self._tenant_numbers.get(tenant)
        if tenant_number is None:  # never recorded, so nothing to match (and no number spent)
            return {}
        blocks = self._blocks
        held, unknown = 0, len(hashes)  # blocks[:held] are held; blocks[unknown:] are not
        while held < unknown:
            middle = (held + unknown + 1) // 2
            if (hashes[middle - 1] << TENANT_BITS | tenant_number) in blocks:
                held = middle
            else:
                unknown = middle - 1
        if held == 0:
            return {}
        key = hashes[held - 1] << TENANT_BITS | tenant_number
        matches = {blocks[key]: held}
        for slot in self._later:
            holder = slot.get(key)
            if holder is None:
                break
            matches[holder] = held
        return matches

    def record(self, tenant: str, hashes: Sequence[int], replica_id: str) -> None:
        tenant_number = self._tenant_numbers.get(tenant)
        if tenant_number is None:
            tenant_number = self._number_tenant(tenant)
        blocks = self._blocks
        # Last to first: see longest_matches for why earlier blocks must end up fresher.
        for block_hash in reversed(hashes):
            key = block_hash << TENANT_BITS | tenant_number
            first = blocks.get(key)
            if first is None:
                blocks[key] = replica_id
                if len(blocks) > self._capacity:
                    self._forget_holders(blocks.popitem(last=False)[0])
                continue
            blocks.move_to_end(key)
            if first != replica_id:
                self._add_holder(key, replica_id)

    def _number_tenant(self, tenant: str) -> int:
        number = len(self._tenant_numbers)
        if number >= 1 << TENANT_BITS:
            raise OverflowError(f"PrefixIndex numbers at most 2**{TENANT_BITS} tenants")
        self._tenant_numbers[tenant] = number
        return number

    def _add_holder(self, key: int, replica_id: str) -> None:
        """Append `replica_id` to the block's holders unless already there; past the
        bound, the oldest holder goes and the rest shift down a slot."""
        later = self._later
        count = 1
        for slot in later:
            holder = slot.get(key)
            if holder is None:
                break
            if holder == replica_id:
                return
            count += 1
        if count <= len(later):
            later[count - 1][key] = replica_id
            return
        # Full: assigning to an existing OrderedDict key keeps its (just refreshed) place.
        if later:
            self._blocks[key] = later[0][key]
            for slot, successor in pairwise(later):
                slot[key] = successor[key]
            later[-1][key] = replica_id
        else:
            self._blocks[key] = replica_id

    def _forget_holders(self, key: int) -> None:
        for slot in self._later:
            if slot.pop(key, None) is None:
                break
