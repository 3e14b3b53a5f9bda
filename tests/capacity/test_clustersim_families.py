"""The workload families: deterministic per seed, the lengths and prefix structure each one
claims, spread over tenants and tiers, and --family on the simulator's CLI and
bench/routing.py."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

import pytest

from serving.clustersim import SimRequest
from serving.clustersim.families import (
    CHUNK,
    FAMILIES,
    Blend,
    BurstyFamily,
    DiurnalFamily,
    FamilyError,
    family,
    parse_blend,
    parse_families,
)
from serving.clustersim.workloads import BLOCK_TOKENS, diurnal_rate

REPO = Path(__file__).resolve().parents[2]
WINDOW_S = 60.0
PER_CHUNK = CHUNK // BLOCK_TOKENS


def generated(name: str, *, seed: int | None = None, rate: float | None = None) -> list[SimRequest]:
    return FAMILIES[name].generate(seed=seed, rate=rate, duration_s=WINDOW_S)


def shared_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def test_there_are_the_six_families() -> None:
    assert set(FAMILIES) == {"code", "generation", "chat", "rag", "bursty", "diurnal"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_generates_the_same_requests_for_a_seed_and_others_for_another(
    name: str,
) -> None:
    first, again = generated(name, seed=5, rate=20), generated(name, seed=5, rate=20)
    assert first == again
    assert generated(name, seed=6, rate=20) != first
    assert generated(name) == generated(name)  # its own seed


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_spreads_over_several_tenants_and_the_three_tiers(name: str) -> None:
    requests = generated(name)
    assert len({r.tenant for r in requests}) >= 2
    assert {r.tier for r in requests} == {"interactive", "standard", "batch"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_is_in_arrival_order_within_its_window_with_unique_ids(name: str) -> None:
    requests = generated(name)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0 and arrivals[-1] < WINDOW_S
    assert len({r.request_id for r in requests}) == len(requests)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_familys_rate_scales_its_requests(name: str) -> None:
    low = len(generated(name, rate=10))
    high = len(generated(name, rate=40))
    assert 3 < high / low < 5


@pytest.mark.parametrize("name", ["code", "chat", "rag", "bursty", "diurnal"])
def test_block_hashes_cover_the_prompts_full_blocks(name: str) -> None:
    for r in generated(name):
        assert len(r.block_hashes) == r.prompt_tokens // BLOCK_TOKENS


def test_code_prompts_are_long_and_outputs_short() -> None:
    requests = generated("code")
    assert all(2000 <= r.prompt_tokens <= 6000 for r in requests)
    assert all(30 <= r.output_tokens <= 150 for r in requests)
    assert statistics.median(r.prompt_tokens for r in requests) > 30 * statistics.median(
        r.output_tokens for r in requests
    )


def test_code_requests_of_a_tenant_share_a_repository_context() -> None:
    by_root: Counter[tuple[str, int]] = Counter(
        (r.tenant, r.block_hashes[0]) for r in generated("code")
    )
    # A repository is at least 3 chunks: requests on one share at least that many blocks.
    assert max(by_root.values()) > 20
    requests = generated("code")
    first = requests[0]
    same = [r for r in requests[1:] if r.block_hashes[0] == first.block_hashes[0]]
    assert same
    assert all(shared_prefix(first.block_hashes, r.block_hashes) >= 3 * PER_CHUNK for r in same)


def test_generation_prompts_are_short_and_outputs_long() -> None:
    requests = generated("generation")
    assert all(100 <= r.prompt_tokens <= 500 for r in requests)
    assert all(500 <= r.output_tokens <= 2000 for r in requests)
    assert statistics.median(r.output_tokens for r in requests) > 2 * statistics.median(
        r.prompt_tokens for r in requests
    )


def test_a_chat_turn_begins_with_the_previous_turn_and_its_reply() -> None:
    turns: dict[str, list[SimRequest]] = defaultdict(list)
    for r in generated("chat"):
        turns[r.request_id.partition(".")[0]].append(r)
    checked = 0
    for in_order in turns.values():
        for before, after in pairwise(in_order):
            assert after.block_hashes[: len(before.block_hashes)] == before.block_hashes
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
            assert after.arrival_s > before.arrival_s
            assert after.tenant == before.tenant
            checked += 1
    assert checked > 100
    lengths = Counter(len(c) for c in turns.values())
    assert max(lengths) > 2  # conversations of several turns, not pairs


def test_chat_conversations_of_a_tenant_share_its_system_prompt() -> None:
    firsts: dict[str, set[int]] = defaultdict(set)
    for r in generated("chat"):
        firsts[r.tenant].add(r.block_hashes[0])
    assert all(len(roots) == 1 for roots in firsts.values())
    assert len({next(iter(roots)) for roots in firsts.values()}) == len(firsts)  # salted


def test_chat_opens_its_window_at_the_familys_rate() -> None:
    """Conversations last minutes: begun too late before the window, it opens short of the
    rate (from 120 s before, 0.92 of it over the first minute) and ramps up through it."""
    spec = FAMILIES["chat"]
    shares = [
        len(spec.generate(seed=seed, duration_s=60.0)) / 60.0 / spec.rate_per_s
        for seed in (1, 2, 3, 4)
    ]
    assert sum(shares) / len(shares) > 0.96


def test_rag_requests_share_document_blocks_after_the_system_prompt() -> None:
    requests = generated("rag")
    past_system = Counter(
        (r.tenant, r.block_hashes[2 * PER_CHUNK - 1]) for r in requests
    )  # the first document's first chunk, after the one-chunk system prompt
    popular = past_system.most_common(1)[0][1]
    assert popular > 0.05 * len(requests) / len({r.tenant for r in requests})
    assert all(r.prompt_tokens > CHUNK * 2 for r in requests)  # system prompt + a document


def test_bursty_peak_windows_exceed_the_base_rate() -> None:
    spec = FAMILIES["bursty"]
    assert isinstance(spec, BurstyFamily)
    requests = generated("bursty")
    per_window = Counter(int(r.arrival_s // 5) for r in requests)
    peak = max(per_window.values()) / 5
    trough = min(per_window.values()) / 5
    assert peak > 2.5 * spec.rate_per_s
    assert trough < 1.5 * spec.rate_per_s


def test_diurnal_arrivals_follow_the_sinusoid() -> None:
    spec = FAMILIES["diurnal"]
    assert isinstance(spec, DiurnalFamily)
    requests = spec.generate(duration_s=240.0)
    bins = 8
    width = 240.0 / bins
    observed = Counter(int(r.arrival_s // width) for r in requests)
    expected = [
        diurnal_rate(spec.rate_per_s, spec.peak_to_trough, 240.0, (i + 0.5) * width) * width
        for i in range(bins)
    ]
    for i in range(bins):
        assert abs(observed[i] - expected[i]) < 0.15 * expected[i] + 30
    assert observed[bins // 2] > 2.5 * observed[0]


def test_families_parse_from_names_or_all() -> None:
    assert parse_families("all") == list(FAMILIES)
    assert parse_families("code,chat") == ["code", "chat"]
    with pytest.raises(FamilyError, match="unknown workload family 'nope'"):
        family("nope")


def test_a_blend_parses_with_each_familys_rate_or_its_own() -> None:
    blend = parse_blend("code:48+generation")
    assert blend == Blend((("code", 48.0), ("generation", FAMILIES["generation"].rate_per_s)))
    assert blend.name == f"code:48+generation:{FAMILIES['generation'].rate_per_s:g}"
    assert blend.rate_per_s == 48.0 + FAMILIES["generation"].rate_per_s
    assert family("code:48+generation:24") == Blend((("code", 48.0), ("generation", 24.0)))
    assert parse_families("chat,code:48+generation:24") == ["chat", "code:48+generation:24"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("code:48+nope:3", "unknown workload family 'nope'"),
        ("code:48+code:3", "family 'code' twice in one blend"),
        ("code:0+generation:3", "RATE > 0"),
        ("code:fast+generation:3", "RATE > 0"),
        ("code:nan", "RATE > 0"),
    ],
)
def test_a_bad_blend_is_refused_by_name(text: str, match: str) -> None:
    with pytest.raises(FamilyError, match=match):
        family(text)


def test_a_blend_is_its_parts_as_generated_alone_in_arrival_order() -> None:
    blend = Blend((("code", 6.0), ("generation", 3.0)))
    requests = blend.generate(seed=2, duration_s=WINDOW_S)
    code = FAMILIES["code"].generate(seed=FAMILIES["code"].seed + 2, rate=6.0, duration_s=WINDOW_S)
    generation = FAMILIES["generation"].generate(
        seed=FAMILIES["generation"].seed + 2, rate=3.0, duration_s=WINDOW_S
    )
    assert code and generation
    assert sorted(requests, key=lambda r: r.request_id) == sorted(
        code + generation, key=lambda r: r.request_id
    )
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert len({r.request_id for r in requests}) == len(requests)
    # A rate rescales every part alike: 18 requests/s is each part's at twice its own.
    doubled = blend.generate(seed=2, rate=18.0, duration_s=WINDOW_S)
    code_doubled = FAMILIES["code"].generate(
        seed=FAMILIES["code"].seed + 2, rate=12.0, duration_s=WINDOW_S
    )
    assert [r for r in doubled if r.request_id.startswith(code[0].request_id[:2])] == code_doubled


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_the_simulator_cli_runs_a_family(tmp_path: Path) -> None:
    done = run_script(
        "-m", "serving.clustersim", "--family", "rag", "--rate", "5", "--duration", "10",
        "--seed", "3", "--fleet", "L40S-48GB:1", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "cost_aware on 1x L40S-48GB" in done.stdout
    assert "prompt tokens per engine step: L40S-48GB 512 (--engine-budget platform)" in done.stdout
    assert any(tmp_path.iterdir())


def test_the_simulator_cli_refuses_an_unknown_family_with_status_2() -> None:
    done = run_script("-m", "serving.clustersim", "--family", "nope")
    assert done.returncode == 2
    assert "unknown workload family 'nope'" in done.stderr


TINY = (
    "--duration", "5", "--max-replicas", "2", "--gpus", "L40S-48GB", "--mixes", "L40S-48GB:1",
    "--policies", "least_load", "--workers", "1",
)  # fmt: skip


def test_routing_runs_a_family_and_writes_its_search_as_json(tmp_path: Path) -> None:
    out = tmp_path / "families.json"
    done = run_script(
        "bench/routing.py", "--families", "chat", "--rate", "4", *TINY, "--json", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert "chat at 4 requests/s, 5 s" in done.stdout
    (entry,) = json.loads(out.read_text())["smallest"]
    assert entry["trace"] == entry["family"] == "chat"
    assert entry["policy"] == "least_load" and entry["gpu_class"] == "L40S-48GB"
    assert "chat: least_load" in done.stdout  # the fleet verdicts


def test_routing_runs_a_blend_of_families_on_one_fleet(tmp_path: Path) -> None:
    out = tmp_path / "blend.json"
    done = run_script(
        "bench/routing.py", "--families", "code:3+generation:2", *TINY, "--json", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert "code:3+generation:2 at 5 requests/s, 5 s" in done.stdout
    (entry,) = json.loads(out.read_text())["smallest"]
    assert entry["family"] == "code:3+generation:2"


def test_routing_refuses_an_unknown_family_with_status_2() -> None:
    done = run_script("bench/routing.py", "--families", "code,nope", *TINY)
    assert done.returncode == 2
    assert "unknown workload family 'nope': one of code, generation" in done.stderr


def test_routing_refuses_an_unknown_policy_with_status_2() -> None:
    done = run_script("bench/routing.py", "--families", "chat", "--policies", "fastest")
    assert done.returncode == 2
    assert "--policies: unknown policy 'fastest': one of round_robin" in done.stderr


@pytest.mark.parametrize("budget", ["0", "big", "-512"])
def test_routing_refuses_an_engine_budget_that_is_not_a_name_or_a_count(budget: str) -> None:
    done = run_script("bench/routing.py", "--families", "chat", f"--engine-budget={budget}")
    assert done.returncode == 2
    assert f"--engine-budget: {budget!r}: platform, vllm or a positive number" in done.stderr


def test_routing_refuses_an_engine_budget_below_max_num_seqs_with_status_2() -> None:
    done = run_script("bench/routing.py", "--families", "chat", "--engine-budget", "128")
    assert done.returncode == 2
    assert "--engine-budget: max_num_batched_tokens (128) is below max_num_seqs (256)" in (
        done.stderr
    )


def test_the_simulator_cli_refuses_an_engine_budget_below_max_num_seqs_with_status_2() -> None:
    done = run_script("-m", "serving.clustersim", "--duration", "1", "--engine-budget", "128")
    assert done.returncode == 2
    assert "--engine-budget: max_num_batched_tokens (128) is below max_num_seqs" in done.stderr
