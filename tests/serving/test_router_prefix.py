"""The prefix index: int keys and holders in one string behave exactly like a plain LRU of
(tenant, block hash) -> holders, keep tenants apart, and allocate nothing the garbage
collector tracks on the routing path."""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.router import PrefixIndex


class ReferenceIndex:
    """The contract spelt out naively: tuple keys, an ordered dict of holders per block."""

    def __init__(self, capacity_blocks: int, replicas_per_block: int) -> None:
        self.capacity = capacity_blocks
        self.replicas_per_block = replicas_per_block
        self.blocks: OrderedDict[tuple[str, int], dict[str, None]] = OrderedDict()

    def longest_matches(self, tenant: str, hashes: Sequence[int]) -> dict[str, int]:
        # The same binary search as the index: for prompts that do not chain their hashes
        # (as these random ones do not), "held" is not monotone and the probe order matters.
        held, unknown = 0, len(hashes)
        while held < unknown:
            middle = (held + unknown + 1) // 2
            if (tenant, hashes[middle - 1]) in self.blocks:
                held = middle
            else:
                unknown = middle - 1
        if held == 0:
            return {}
        return dict.fromkeys(self.blocks[(tenant, hashes[held - 1])], held)

    def record(self, tenant: str, hashes: Sequence[int], replica_id: str) -> None:
        for block_hash in reversed(hashes):
            key = (tenant, block_hash)
            holders = self.blocks.setdefault(key, {})
            self.blocks.move_to_end(key)
            if replica_id not in holders:
                holders[replica_id] = None
            if len(holders) > self.replicas_per_block:
                del holders[next(iter(holders))]
            if len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)


TENANTS = ("acme", "globex", "0", "1", "")
REPLICAS = ("a", "b", "c", "d", "e", "")
# Negative, 64-bit and wider hashes: the int key must stay injective for all of them.
HASHES = st.sampled_from((0, 1, 2, 3, -1, -(2**63), 2**63 - 1, 2**64 + 1, 1 << 32, 7 << 32))
PROMPTS = st.lists(HASHES, min_size=0, max_size=6, unique=True).map(tuple)


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 12),
    replicas_per_block=st.integers(1, 4),
    steps=st.lists(
        st.tuples(st.booleans(), st.sampled_from(TENANTS), PROMPTS, st.sampled_from(REPLICAS)),
        max_size=40,
    ),
)
def test_the_index_answers_exactly_as_a_plain_lru_of_tenant_and_block(
    capacity: int,
    replicas_per_block: int,
    steps: list[tuple[bool, str, tuple[int, ...], str]],
) -> None:
    index = PrefixIndex(capacity_blocks=capacity, replicas_per_block=replicas_per_block)
    reference = ReferenceIndex(capacity, replicas_per_block)
    for is_record, tenant, hashes, replica_id in steps:
        if is_record:
            index.record(tenant, hashes, replica_id)
            reference.record(tenant, hashes, replica_id)
            assert len(index) == len(reference.blocks)
        else:
            matches = index.longest_matches(tenant, hashes)
            expected = reference.longest_matches(tenant, hashes)
            assert list(matches.items()) == list(expected.items())


def test_a_block_hash_shifted_into_the_tenant_bits_is_not_another_tenants_hit() -> None:
    # "acme" is tenant 0 and "globex" tenant 1: a key scheme that added the tenant number
    # to an unshifted hash would make acme's block 1 globex's block 0.
    index = PrefixIndex()
    index.record("acme", (1,), "a")
    index.record("globex", (5,), "b")
    assert index.longest_matches("globex", (0,)) == {}
    assert index.longest_matches("acme", (1 << 32 | 1,)) == {}
    assert index.longest_matches("acme", (1,)) == {"a": 1}


def test_the_same_hash_under_two_tenants_is_two_blocks() -> None:
    index = PrefixIndex()
    index.record("acme", (-(2**63), 2**64 + 1), "a")
    index.record("globex", (-(2**63), 2**64 + 1), "b")
    assert len(index) == 4
    assert index.longest_matches("acme", (-(2**63), 2**64 + 1)) == {"a": 2}
    assert index.longest_matches("globex", (-(2**63), 2**64 + 1)) == {"b": 2}


def test_looking_up_an_unknown_tenant_finds_nothing_and_numbers_no_tenant() -> None:
    index = PrefixIndex()
    assert index.longest_matches("stranger", (1, 2)) == {}
    index.record("acme", (1, 2), "a")
    assert index.longest_matches("acme", (1, 2)) == {"a": 2}
    assert index._tenant_numbers == {"acme": 0}


def test_eviction_takes_the_least_recently_recorded_block_across_tenants() -> None:
    index = PrefixIndex(capacity_blocks=3)
    index.record("acme", (1,), "a")
    index.record("globex", (1,), "b")
    index.record("acme", (2,), "a")
    index.record("acme", (1,), "a")  # refresh: globex's block is now the oldest
    index.record("initech", (9,), "c")
    assert index.longest_matches("globex", (1,)) == {}
    assert index.longest_matches("acme", (1,)) == {"a": 1}
    assert index.longest_matches("acme", (2,)) == {"a": 1}
    assert index.longest_matches("initech", (9,)) == {"c": 1}


def test_a_block_keeps_its_last_distinct_holders_oldest_first() -> None:
    index = PrefixIndex(replicas_per_block=3)
    for replica_id in ("a", "b", "a", "c", "d"):
        index.record("acme", (1,), replica_id)
    assert list(index.longest_matches("acme", (1,))) == ["b", "c", "d"]


def test_an_evicted_block_comes_back_with_only_its_new_holder() -> None:
    index = PrefixIndex(capacity_blocks=1, replicas_per_block=3)
    index.record("acme", (1,), "a")
    index.record("acme", (1,), "b")
    index.record("acme", (2,), "c")  # evicts block 1 and both its holders
    index.record("acme", (1,), "d")
    assert index.longest_matches("acme", (1,)) == {"d": 1}


def test_recording_new_blocks_allocates_nothing_the_garbage_collector_tracks() -> None:
    index = PrefixIndex(capacity_blocks=500)
    index.record("acme", (0,), "warm")  # numbers the tenant
    prompts = [tuple(range(start, start + 8)) for start in range(1, 4_000, 8)]
    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        for n, hashes in enumerate(prompts):
            index.record("acme", hashes, f"r{n % 3}" if n % 2 else "r0")
            index.longest_matches("acme", hashes)
        grown = gc.get_count()[0] - before
    finally:
        gc.enable()
    # 4,000 new blocks; the old index allocated two tracked objects for each.
    assert grown < 50


def test_a_replica_id_holding_the_holder_separator_is_refused_and_records_nothing() -> None:
    index = PrefixIndex()
    index.record("acme", (1,), "a")
    with pytest.raises(ValueError, match="replica id"):
        index.record("acme", (1, 2), "b\x1fa")
    assert len(index) == 1
    assert index.longest_matches("acme", (1, 2)) == {"a": 1}


def test_a_replica_is_credited_with_no_more_than_its_kv_holds_the_most_recent_first() -> None:
    """vLLM reuses the least recently used free block first: a replica holds about the last
    KV capacity's worth of blocks written there, and forgets a prompt's tail first."""
    index = PrefixIndex(block_tokens=16)
    index.hold_at_most("small", 5 * 16)  # five blocks of KV
    index.record("acme", [1, 2, 3], "small")
    index.record("acme", [1, 2, 3], "big")
    assert index.longest_matches("acme", [1, 2, 3]) == {"small": 3, "big": 3}
    index.record("acme", [7, 8, 9], "small")  # six blocks written: block 3 goes first
    assert index.longest_matches("acme", [7, 8, 9]) == {"small": 3}
    # The replica with no known capacity still holds all of it; the small one, a prefix.
    assert index.longest_matches("acme", [1, 2, 3]) == {"big": 3}
    assert index.longest_matches("acme", [1, 2]) == {"small": 2, "big": 2}
    # Recording again refreshes 1 and 2, so the next block written pushes out 9, the tail
    # of the prompt now least recently recorded.
    index.record("acme", [1, 2], "small")
    index.record("acme", [4], "small")
    assert index.longest_matches("acme", [1, 2]) == {"small": 2, "big": 2}
    assert index.longest_matches("acme", [7, 8, 9]) == {"small": 2}


def test_a_block_held_only_by_a_replica_that_forgot_it_leaves_the_index() -> None:
    index = PrefixIndex(block_tokens=16)
    index.hold_at_most("r", 2 * 16)
    index.record("acme", [1, 2], "r")
    index.record("acme", [5, 6], "r")
    assert index.longest_matches("acme", [1, 2]) == {}
    assert len(index) == 2


def test_a_block_the_index_evicts_leaves_its_holders_own_records() -> None:
    """The global LRU and a replica's own stay consistent: a block evicted from the index
    does not count against the replica's capacity afterwards."""
    index = PrefixIndex(capacity_blocks=3, block_tokens=16)
    index.hold_at_most("r", 3 * 16)
    index.record("acme", [1, 2, 3], "s")
    index.record("acme", [4, 5], "r")  # evicts 3 and 2 (s's), 4 and 5 now r's
    index.record("acme", [6], "r")  # evicts 1; r holds 4, 5, 6: within its three blocks
    assert index.longest_matches("acme", [4, 5]) == {"r": 2}
    assert index.longest_matches("acme", [6]) == {"r": 1}


def test_a_replica_without_known_capacity_is_bounded_only_by_the_index() -> None:
    index = PrefixIndex()
    index.record("acme", list(range(1, 1001)), "r")
    assert index.longest_matches("acme", list(range(1, 1001))) == {"r": 1000}


def test_the_router_state_bounds_each_replica_by_its_kv_capacity() -> None:
    from tests.serving.test_router import fleet, replica

    small = replica("small")
    state = fleet(small)
    blocks = small.perf.kv_capacity_tokens // 16
    hashes = list(range(1, blocks + 11))
    state.prefix_index.record("acme", hashes, "small")
    # The first blocks recorded last (a prompt is refreshed last to first) are kept.
    assert state.prefix_index.longest_matches("acme", hashes) == {"small": blocks}


def test_a_replica_finds_its_own_run_where_the_longest_holders_are_others() -> None:
    """`longest_matches` reports only the holders of the longest run; a replica holding a
    shorter run (the tenant's repository, not this session's file) finds it in its own
    record."""
    index = PrefixIndex(block_tokens=16)
    for replica_id in ("repo", "session", "unbounded"):
        if replica_id != "unbounded":
            index.hold_at_most(replica_id, 1_000 * 16)
    repository, session = (1, 2, 3, 4), (1, 2, 3, 4, 5, 6)
    index.record("acme", repository, "repo")
    index.record("acme", repository, "unbounded")
    index.record("acme", session, "session")
    assert index.longest_matches("acme", session) == {"session": 6}

    def run_on(replica_id: str, tenant: str, hashes: Sequence[int]) -> int:
        key = index.first_key(tenant, hashes)
        return 0 if key is None else index.run_on(replica_id, key, hashes)

    assert run_on("repo", "acme", session) == 4
    assert run_on("session", "acme", session) == 6
    assert run_on("session", "acme", (1, 2, 9)) == 2
    # No record of its own: a replica without a known KV capacity, one never sent
    # anything, a prompt it holds no first block of; no key for a tenant that recorded
    # nothing or no prompt at all.
    assert run_on("unbounded", "acme", session) == 0
    assert run_on("idle", "acme", session) == 0
    assert run_on("repo", "acme", (9, 2, 3)) == 0
    assert index.first_key("globex", session) is None
    assert index.first_key("acme", ()) is None
    index.record("globex", session, "repo")  # another tenant's same hashes: its own blocks
    assert run_on("repo", "globex", session) == 6
    assert run_on("session", "globex", session) == 0


def test_a_replica_keeps_its_own_run_of_a_block_with_more_holders_than_the_index_lists() -> None:
    index = PrefixIndex(replicas_per_block=2, block_tokens=16)
    for replica_id in ("a", "b", "c"):
        index.hold_at_most(replica_id, 1_000 * 16)
        index.record("acme", (1, 2), replica_id)
    assert index.longest_matches("acme", (1, 2)) == {"b": 2, "c": 2}
    key = index.first_key("acme", (1, 2, 3))
    assert key is not None and index.run_on("a", key, (1, 2, 3)) == 2


def chained(chunks: Sequence[int]) -> tuple[int, ...]:
    """Block hashes as vLLM chains them: each stands for its block and every one before it,
    so a hash occurs at one position only."""
    return tuple(hash(tuple(chunks[: i + 1])) for i in range(len(chunks)))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(("a", "b", "c")),
            st.lists(st.integers(0, 2), min_size=1, max_size=6),
        ),
        min_size=1,
        max_size=40,
    ),
    st.lists(st.integers(0, 2), min_size=1, max_size=6),
)
def test_a_replicas_own_run_is_the_longest_prefix_its_own_lru_holds(
    records: list[tuple[str, list[int]]], probe_chunks: list[int]
) -> None:
    """Against a plain model: each replica an LRU of its last eight blocks, refreshed last
    to first; its run is the longest prefix of the probe it holds."""
    index = PrefixIndex(block_tokens=16)
    model: dict[str, OrderedDict[int, None]] = {}
    for replica_id, chunks in records:
        hashes = chained(chunks)
        index.hold_at_most(replica_id, 8 * 16)
        held = model.setdefault(replica_id, OrderedDict())
        index.record("acme", hashes, replica_id)
        for block in reversed(hashes):
            held[block] = None
            held.move_to_end(block)
        while len(held) > 8:
            held.popitem(last=False)
    probe = chained(probe_chunks)
    for replica_id, held in model.items():
        run = 0
        while run < len(probe) and probe[run] in held:
            run += 1
        key = index.first_key("acme", probe)
        assert key is not None and index.run_on(replica_id, key, probe) == run
