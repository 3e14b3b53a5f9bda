"""What a gateway keeps of its own view of a replica when a new routing-table version comes."""

from __future__ import annotations

from typing import Any

from serving.gateway.routing import build_snapshot, carry_over

MODEL = "llama-3.1-8b"


def table(version: int, gpu_class: str, budget: int | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "replica_id": "r-1",
        "endpoint": "http://127.0.0.1:9",
        "pool": "pool",
        "region": "us-east",
        "gpu_class": gpu_class,
        "model_spec": MODEL,
        "price_per_hour": 1.0,
        "tensor_parallel": 1,
        "max_num_seqs": 256,
        "max_num_batched_tokens": budget,
    }
    deployment = {"deployment_id": "1", "version": "v1", "weight": 100, "replicas": [row]}
    return {"version": version, "models": {MODEL: {"deployments": [deployment]}}}


def test_requests_in_flight_and_the_ttft_scale_carry_over_while_the_replica_is_the_same() -> None:
    previous = build_snapshot(table(1, "L40S-48GB", 512))
    old = previous.state.replica("r-1")
    assert old is not None
    old.inflight, old.ttft_scale = 3, 1.4
    same = build_snapshot(table(2, "L40S-48GB", 512), previous.state.prefix_index)
    carry_over(previous, same)
    new = same.state.replica("r-1")
    assert new is not None and (new.inflight, new.ttft_scale) == (3, 1.4)


def test_a_replica_whose_perf_changed_learns_its_ttft_scale_again() -> None:
    """The scale calibrates the replica as the router models it: another engine budget (or
    another class under the same id) is another model, and the old error says nothing of it.
    Its requests in flight still count."""
    previous = build_snapshot(table(1, "L40S-48GB", 512))
    old = previous.state.replica("r-1")
    assert old is not None
    old.inflight, old.ttft_scale = 3, 1.4
    for changed in (table(2, "L40S-48GB", 1024), table(2, "H100-SXM-80GB", 512)):
        snapshot = build_snapshot(changed, previous.state.prefix_index)
        carry_over(previous, snapshot)
        new = snapshot.state.replica("r-1")
        assert new is not None and (new.inflight, new.ttft_scale) == (3, 1.0)
