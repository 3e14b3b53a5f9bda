"""Traces for the cluster simulator: the shipped copies, any file in the Azure or Mooncake
format, tenants spread over every trace, and bench/routing.py's search on both clocks."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import routing
from serving.clustersim import SimRequest, homogeneous, simulate, summarize
from serving.clustersim.__main__ import main as cli_main
from serving.clustersim.simulator import SimConfig
from serving.clustersim.workloads import (
    AZURE_CONV_CSV,
    DEFAULT_TENANTS,
    MOONCAKE_JSONL,
    TRACES_DIR,
    TraceError,
    load_azure_conversation,
    load_mooncake,
    load_trace,
    mean_rate,
    read_mooncake,
)
from serving.router import RouterConfig, SloTier

REPO = Path(__file__).resolve().parents[2]
H100, L40S = "H100-SXM-80GB", "L40S-48GB"


def write_mooncake(path: Path, count: int, *, spacing_ms: int = 250, start_ms: int = 0) -> Path:
    """`count` requests, all beginning with the same 512-token block (one shared system
    prompt), each with a block of its own after it."""
    rows = [
        {
            "timestamp": start_ms + i * spacing_ms,
            "input_length": 600 + 7 * i,
            "output_length": 20,
            "hash_ids": [0, 1000 + i],
        }
        for i in range(count)
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_the_default_traces_are_inside_the_repository() -> None:
    for path in (AZURE_CONV_CSV, MOONCAKE_JSONL):
        assert path.is_file()
        assert path.is_relative_to(REPO / "serving" / "clustersim" / "data" / "traces")


def test_the_shipped_traces_load_without_opening_anything_outside_the_repository(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[Path] = []
    real_open = Path.open

    def recording_open(self: Path, *args: object, **kwargs: object) -> object:
        opened.append(self.resolve())
        return real_open(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(Path, "open", recording_open)
    azure = load_azure_conversation()
    mooncake = load_mooncake()
    assert (len(azure), len(mooncake)) == (19366, 3993)
    assert opened and all(path.is_relative_to(REPO) for path in opened)


def test_the_shipped_traces_are_the_published_files_unmodified() -> None:
    readme = (TRACES_DIR / "README.md").read_text()
    for path in (AZURE_CONV_CSV, MOONCAKE_JSONL):
        section = readme[readme.index(f"## {path.name}") :]
        listed = re.search(r"sha256: `([0-9a-f]{64})`", section)
        assert listed is not None
        assert hashlib.sha256(path.read_bytes()).hexdigest() == listed.group(1)


def test_a_trace_whose_requests_all_share_one_first_block_spreads_over_tenants_and_tiers(
    tmp_path: Path,
) -> None:
    requests = load_mooncake(write_mooncake(tmp_path / "one_root.jsonl", 400))
    tenants = Counter(r.tenant for r in requests)
    assert set(tenants) == {t.name for t in DEFAULT_TENANTS}
    assert {r.tier for r in requests} == {"interactive", "standard", "batch"}
    for tenant in DEFAULT_TENANTS:
        assert tenants[tenant.name] / len(requests) == pytest.approx(tenant.weight, abs=0.08)


def test_requests_of_one_tenant_still_share_the_common_first_block(tmp_path: Path) -> None:
    requests = load_mooncake(write_mooncake(tmp_path / "one_root.jsonl", 40))
    acme = [r for r in requests if r.tenant == "acme"]
    globex = [r for r in requests if r.tenant == "globex"]
    assert len({r.block_hashes[:32] for r in acme}) == 1
    assert not {r.block_hashes[0] for r in acme} & {r.block_hashes[0] for r in globex}


def test_with_many_roots_each_tenant_gets_its_weight_share_to_half_a_percent() -> None:
    requests = load_mooncake()
    tenants = Counter(r.tenant for r in requests)
    for tenant in DEFAULT_TENANTS:
        assert tenants[tenant.name] / len(requests) == pytest.approx(tenant.weight, abs=0.005)


def test_rate_rescales_a_trace_to_that_many_requests_per_second_on_average(
    tmp_path: Path,
) -> None:
    trace = write_mooncake(tmp_path / "trace.jsonl", 50, spacing_ms=1000)
    assert mean_rate(read_mooncake(trace)) == pytest.approx(1.0)
    requests = load_trace(trace, "mooncake", rate_per_s=4.0)
    assert (len(requests) - 1) / requests[-1].arrival_s == pytest.approx(4.0)


def test_a_trace_is_replayed_from_its_first_request(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path / "late.jsonl", 5, start_ms=1_700_000_000_000)
    assert [r.arrival_s for r in load_trace(trace, "mooncake")] == pytest.approx(
        [0.0, 0.25, 0.5, 0.75, 1.0]
    )


def test_an_unparsable_row_is_refused_with_its_line(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path / "trace.jsonl", 3)
    trace.write_text(trace.read_text() + '{"timestamp": 900, "input_length": 10}\n')
    with pytest.raises(TraceError, match=r"line 4: .*no 'output_length'"):
        load_trace(trace, "mooncake")


@pytest.mark.parametrize(
    ("first", "second", "gap_s"),
    [
        # The 2023 traces: seven fractional digits, no zone.
        ("2023-11-16 18:15:46.6805900", "2023-11-16 18:15:47.5000000", 0.81941),
        # The 2024 traces: microseconds and a zone.
        ("2024-05-10 00:00:00.009930+00:00", "2024-05-10 00:00:02.000000+00:00", 1.99007),
        # A shorter fraction with a zone, and ISO's T and Z.
        ("2023-11-16 18:15:46.68+00:00", "2023-11-16T18:15:47Z", 0.32),
        # Zones are honoured: the second is an hour behind in its own zone, so 1 s later.
        ("2023-11-16 18:15:46+00:00", "2023-11-16 17:15:47-01:00", 1.0),
        # Plain seconds.
        ("12.5", "14", 1.5),
    ],
)
def test_azure_timestamps_are_read_in_every_form_the_traces_write(
    tmp_path: Path, first: str, second: str, gap_s: float
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{first},100,10\n{second},200,0\n")
    requests = load_trace(trace, "azure")
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, gap_s], abs=1e-6)
    assert [r.prompt_tokens for r in requests] == [100, 200]


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ("nan,100,10", "line 3: .*not a finite number"),
        ("2023-11-16 18:15:47,100,10", "line 3: .*mix dates and plain seconds"),
        ("13,-5,10", "line 3: .*negative token count"),
        ("13,100,", "line 3: not an Azure row"),
    ],
)
def test_a_bad_azure_row_is_refused_with_its_line(tmp_path: Path, row: str, match: str) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n12,100,10\n{row}\n")
    with pytest.raises(TraceError, match=match):
        load_trace(trace, "azure")


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ('{"timestamp": 900, "input_length": -1, "output_length": 3}', "negative token count"),
        ('{"timestamp": "inf", "input_length": 1, "output_length": 3}', "not a finite number"),
        (
            '{"timestamp": 900, "input_length": 1, "output_length": 3, "hash_ids": null}',
            "not a Mooncake row",
        ),
    ],
)
def test_a_bad_mooncake_row_is_refused_with_its_line(tmp_path: Path, row: str, match: str) -> None:
    trace = write_mooncake(tmp_path / "trace.jsonl", 3)
    trace.write_text(trace.read_text() + row + "\n")
    with pytest.raises(TraceError, match=f"line 4: .*{match}"):
        load_trace(trace, "mooncake")


def test_a_file_of_the_other_format_is_refused_by_name() -> None:
    with pytest.raises(TraceError, match="not an Azure trace"):
        load_trace(MOONCAKE_JSONL, "azure")
    with pytest.raises(TraceError, match="line 1: not a Mooncake row"):
        load_trace(AZURE_CONV_CSV, "mooncake")


@pytest.mark.slow
def test_the_cli_replays_any_mooncake_format_file(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path / "tmp.jsonl", 40)
    done = run_script(
        "-m",
        "serving.clustersim",
        "--trace",
        str(trace),
        "--format",
        "mooncake",
        "--duration",
        "5",
        "--fleet",
        f"{L40S}:1",
        "--policy",
        "least_load",
    )
    assert done.returncode == 0, done.stderr
    assert f"least_load on 1x {L40S}: 20 requests" in done.stdout


def test_the_cli_refuses_an_unknown_format_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_mooncake(tmp_path / "tmp.jsonl", 3)
    with pytest.raises(SystemExit) as exited:
        cli_main(["--trace", str(trace), "--format", "csv"])
    assert exited.value.code == 2
    assert "invalid choice: 'csv'" in capsys.readouterr().err


def test_the_cli_refuses_a_missing_file_or_the_wrong_format_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_mooncake(tmp_path / "tmp.jsonl", 3)
    assert cli_main(["--trace", str(tmp_path / "missing.jsonl"), "--format", "mooncake"]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert cli_main(["--trace", str(trace), "--format", "azure"]) == 2
    assert "not an Azure trace" in capsys.readouterr().err


def batch_only(count: int) -> list[SimRequest]:
    return [SimRequest(f"b{i}", i * 0.5, 500, 10, "umbrella", "batch") for i in range(count)]


def test_a_run_without_interactive_requests_meets_no_slo_and_prints_without_error() -> None:
    summary = summarize(simulate(homogeneous(L40S, 1), batch_only(4)))
    assert "interactive" not in summary.tiers
    assert not routing.meets(summary)
    assert routing.attainment(summary) == 0.0
    assert "1x L40S-48GB" in routing.row("(h)", summary, 0.99)


def test_the_search_judges_tpot_as_well_as_ttft() -> None:
    tiers = {"interactive": SloTier("interactive", 60.0, 0.001)}  # no decode is that fast
    requests = [SimRequest(f"i{i}", i * 0.5, 500, 10, "acme", "interactive") for i in range(4)]
    config = SimConfig(policy="least_load", router=RouterConfig(slo_tiers=tiers))
    summary = summarize(simulate(homogeneous(L40S, 1), requests, config))
    assert summary.tiers["interactive"].ttft_attainment == 1.0
    assert summary.tiers["interactive"].slo_attainment == 0.0
    assert not routing.meets(summary)


SEARCH_ARGS = ("--gpus", L40S, "--mixes", f"{L40S}:1", "--workers", "1")


@pytest.mark.slow
def test_routing_writes_the_homogeneous_search_as_json(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path / "tiny.jsonl", 60)
    out = tmp_path / "search.json"
    done = run_script(
        "bench/routing.py", "--trace", str(trace), "--format", "mooncake",
        "--json", str(out), *SEARCH_ARGS,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    smallest = json.loads(out.read_text())["smallest"]
    # Every searched policy by default: ours and the faithful peers.
    assert {(e["policy"], e["gpu_class"]) for e in smallest} == {
        (policy, L40S) for policy in routing.DEFAULT_SEARCH_POLICIES
    }
    for entry in smallest:
        assert {"policy", "gpu_class", "replicas", "usd_per_hour", "attainment"} <= set(entry)
        assert entry["family"] is None
        assert entry["replicas"] == 1
        # The floor no router goes below: here the one replica the search found.
        assert entry["lower_bound_replicas"] == 1
        # Sixty requests' work per second of their span: a fraction of one replica.
        assert 0.0 < entry["sustained_floor_replicas"] < 1.0
        assert entry["usd_per_hour"] == pytest.approx(0.99)
        assert entry["attainment"] >= 0.99


@pytest.mark.slow
def test_routing_reports_null_when_no_fleet_up_to_the_limit_meets_the_slo(
    tmp_path: Path,
) -> None:
    trace = write_mooncake(tmp_path / "tiny.jsonl", 60)
    out = tmp_path / "search.json"
    done = run_script(
        "bench/routing.py", "--trace", str(trace), "--format", "mooncake", "--rate", "100",
        "--max-replicas", "1", "--json", str(out), "--engine-budget", "vllm", *SEARCH_ARGS,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # At vLLM's own budget (on the platform's smaller one, one replica meets it).
    written = json.loads(out.read_text())
    assert written["engine_budget"] == "vllm"
    assert "engines: --engine-budget vllm, tokens per step: L40S-48GB 2048" in done.stdout
    for entry in written["smallest"]:
        assert entry["replicas"] is None and entry["usd_per_hour"] is None
        assert 0.0 <= entry["attainment"] < 0.99
        # A floor, not a prediction: the burst's work fits one replica's compute and
        # bandwidth, while queueing and chunked prefill make one replica miss the TPOT.
        assert entry["lower_bound_replicas"] == 1


def made_up(attained: float, batch_ttft_p99_s: float = 0.5) -> SimpleNamespace:
    """What the search reads of a summary: failures, the interactive tier's share within
    both clocks, and each tier's TTFT p99."""
    return SimpleNamespace(
        failed=0,
        refused=0,
        requests=1000,
        tiers={
            "interactive": SimpleNamespace(slo_attainment=attained, ttft_p99_s=0.3),
            "batch": SimpleNamespace(slo_attainment=1.0, ttft_p99_s=batch_ttft_p99_s),
        },
    )


def sized(
    attained: dict[int, float],
    ran: list[int],
    start: int = 1,
    batch_waits: dict[int, float] | None = None,
) -> routing.SizeSearch:
    """The search over a made-up fleet whose attainment (and batch TTFT p99) at each size
    is `attained`'s (`batch_waits`') value at the largest key not above it; the sizes it
    ran go into `ran`."""

    def at(values: dict[int, float], size: int, default: float) -> float:
        below = [k for k in values if k <= size]
        return values[max(below)] if below else default

    def evaluate(size: int) -> SimpleNamespace:
        ran.append(size)
        return made_up(at(attained, size, 0.0), at(batch_waits or {}, size, 0.5))

    return routing.search_size(
        evaluate,  # type: ignore[arg-type]
        routing.meets,
        routing.attainment,
        max_size=128,
        start=start,
    )


def test_a_search_keeps_doubling_through_fleets_too_small_to_serve_anything() -> None:
    ran: list[int] = []
    found = sized({1: 0.0, 37: 0.995}, ran)
    assert found.replicas == 37
    assert ran[:7] == [1, 2, 4, 8, 16, 32, 64]


def test_a_fleet_that_leaves_a_tier_waiting_does_not_meet_and_the_search_goes_on() -> None:
    # Interactive within both clocks from 8 replicas on, but batch waits a minute for its
    # first token below 24: the fleet does not keep up with the traffic.
    ran: list[int] = []
    found = sized({1: 0.5, 8: 1.0}, ran, batch_waits={1: 60.0, 24: 2.0})
    assert ran[:6] == [1, 2, 4, 8, 16, 32]
    assert found.replicas == 24
    assert not routing.meets(made_up(1.0, routing.KEEPS_UP_TTFT_S + 1))  # type: ignore[arg-type]
    assert routing.meets(made_up(1.0, routing.KEEPS_UP_TTFT_S))  # type: ignore[arg-type]


def test_a_search_whose_doubling_passes_the_limit_tries_the_limit_itself() -> None:
    ran: list[int] = []
    found = sized({1: 0.1, 10: 0.5, 20: 0.6, 40: 0.8, 80: 0.98, 100: 0.995}, ran, start=10)
    assert ran[:5] == [10, 20, 40, 80, 128]
    assert found.replicas == 100


def test_a_search_gives_up_when_doubling_stops_helping_and_says_where() -> None:
    ran: list[int] = []
    found = sized({1: 0.1, 4: 0.6}, ran)
    assert found.replicas is None
    assert ran == [1, 2, 4, 8]
    assert found.tried == 8
    said = routing.not_met(found, 128)
    assert "stopped at 60.0% on 8" in said


def test_a_search_that_reached_the_limit_says_so() -> None:
    found = sized({1: 0.1, 2: 0.2, 4: 0.3, 8: 0.4, 16: 0.5, 32: 0.6, 64: 0.7, 128: 0.8}, [])
    assert found.replicas is None and found.tried == 128
    assert routing.not_met(found, 128) == "no fleet up to 128 meets it (80.0% on 128)"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trace", "trace_format", "message"),
    [
        ("missing.jsonl", "mooncake", "no such file"),
        ("tiny.jsonl", "azure", "not an Azure trace"),
        ("tiny.jsonl", "parquet", "invalid choice"),
    ],
)
def test_routing_refuses_bad_input_with_status_2(
    tmp_path: Path, trace: str, trace_format: str, message: str
) -> None:
    write_mooncake(tmp_path / "tiny.jsonl", 5)
    done = run_script(
        "bench/routing.py", "--trace", str(tmp_path / trace), "--format", trace_format,
        *SEARCH_ARGS,
    )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_failed_fleet_target_below_every_sustained_floor_is_called_out_of_reach() -> None:
    """Generation's figures: the best peer's cheapest fleet is 5 H100 ($17.45/h); 0.85x of it
    buys 4 H100 (floor 4.39) or 14 L40S (floor 17.04): no router keeps up on either."""
    searches = [
        (H100, "cost_aware", routing.SizeSearch(5, 5, None)),
        (H100, "dynamo_kv", routing.SizeSearch(5, 5, None)),
        (L40S, "cost_aware", routing.SizeSearch(21, 21, None)),
        (L40S, "dynamo_kv", routing.SizeSearch(23, 23, None)),
    ]
    bounds: dict[str, int | None] = {H100: 2, L40S: 8}
    out = routing.fleet_verdicts("generation", searches, bounds, {H100: 4.39, L40S: 17.04})
    [peer] = [line for line in out if "best faithful peer" in line]
    assert "FAIL" in peer and "out of reach" in peer
    # With room under the floor of either class, the failure is cost-aware's own.
    within = routing.fleet_verdicts("generation", searches, bounds, {H100: 3.9, L40S: 17.04})
    [peer] = [line for line in within if "best faithful peer" in line]
    assert "FAIL" in peer and "out of reach" not in peer
    # A fleet found below its floor met only because the run ended first: no verdict on it.
    short = [*searches[:2], (L40S, "cost_aware", routing.SizeSearch(9, 9, None)), searches[3]]
    out = routing.fleet_verdicts("generation", short, bounds, {H100: 4.39, L40S: 17.04})
    [peer] = [line for line in out if "best faithful peer" in line]
    assert "out of reach" not in peer
