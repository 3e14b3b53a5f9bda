"""Placement through the REST API: weights plus one 8K bf16 sequence of KV, 3 GB overhead,
0.9 utilization, per GPU. A refused fit is a 400 that names what would fit."""

from __future__ import annotations

from typing import Any

import pytest

from registry.models import Deployment, Model
from serving.actions.reconcile import launch_budget
from serving.models import GpuPool
from tests.registry.conftest import approved_version, client_for


def _deploy(staff: Any, model: Model, quantization: str, pool: GpuPool, tp: int) -> Any:
    version = approved_version(model, f"v-{quantization}", quantization)
    return client_for(staff).post(
        "/api/v1/deployments/",
        {
            "model_version": version.pk,
            "pool": pool.name,
            "tensor_parallel": tp,
            "engine_args": {},
        },
        format="json",
    )


@pytest.mark.parametrize(
    ("model_name", "quantization", "pool", "tp"),
    [
        ("llama_8b", "bf16", "l4", 1),
        ("llama_70b", "fp8", "h200", 1),
        ("llama_70b", "fp8", "h100", 2),
        ("llama_70b", "bf16", "h100", 4),
    ],
    ids=["8b-bf16-one-l4", "70b-fp8-one-h200", "70b-fp8-tp2-h100", "70b-bf16-tp4-h100"],
)
def test_it_accepts_a_deployment_that_fits(
    request: pytest.FixtureRequest,
    staff: Any,
    pools: dict[str, GpuPool],
    model_name: str,
    quantization: str,
    pool: str,
    tp: int,
) -> None:
    model = request.getfixturevalue(model_name)
    response = _deploy(staff, model, quantization, pools[pool], tp)
    assert response.status_code == 201, response.json()
    deployment = Deployment.objects.get(pk=response.json()["id"])
    assert (deployment.pool, deployment.tensor_parallel) == (pools[pool], tp)


def test_it_refuses_70b_fp8_on_one_h100_and_names_what_would_fit(
    staff: Any, pools: dict[str, GpuPool], llama_70b: Model
) -> None:
    response = _deploy(staff, llama_70b, "fp8", pools["h100"], 1)
    assert response.status_code == 400
    message = " ".join(response.json()["placement"])
    assert "does not fit" in message
    assert "TP 2 on H100-SXM-80GB" in message
    assert "h200-us-east" in message  # the pool where it fits as it stands
    assert not Deployment.objects.exists()


def test_it_refuses_70b_bf16_on_one_l4_and_names_what_would_fit(
    staff: Any, pools: dict[str, GpuPool], llama_70b: Model
) -> None:
    response = _deploy(staff, llama_70b, "bf16", pools["l4"], 1)
    assert response.status_code == 400
    message = " ".join(response.json()["placement"])
    assert "Would fit" in message
    assert "TP 8 on L4-24GB" in message
    assert not Deployment.objects.exists()


def test_a_longer_max_model_len_is_refused_on_update(
    staff: Any, pools: dict[str, GpuPool], llama_8b: Model
) -> None:
    created = _deploy(staff, llama_8b, "bf16", pools["l4"], 1).json()
    response = client_for(staff).patch(
        f"/api/v1/deployments/{created['id']}/",
        {"engine_args": {"max_model_len": 65536}},
        format="json",
    )
    assert response.status_code == 400
    assert "65536-token" in " ".join(response.json()["placement"])
    assert Deployment.objects.get(pk=created["id"]).engine_args == {}


def test_unknown_engine_arguments_are_refused(
    staff: Any, pools: dict[str, GpuPool], llama_8b: Model
) -> None:
    version = approved_version(llama_8b, "v1", "bf16")
    response = client_for(staff).post(
        "/api/v1/deployments/",
        {"model_version": version.pk, "pool": "l4-us-east", "engine_args": {"turbo": True}},
        format="json",
    )
    assert response.status_code == 400
    assert "turbo" in " ".join(response.json()["engine_args"])


def _deploy_with_budget(staff: Any, version: Any, budget: object, pool: str = "l4-us-east") -> Any:
    return client_for(staff).post(
        "/api/v1/deployments/",
        {
            "model_version": version.pk,
            "pool": pool,
            "engine_args": {"max_num_batched_tokens": budget},
        },
        format="json",
    )


@pytest.mark.parametrize(
    ("budget", "problem"),
    [
        (0, "positive whole number"),
        (True, "positive whole number"),
        ("2048", "positive whole number"),
        (128, "at least max_num_seqs"),  # max_num_seqs is 256
    ],
)
def test_a_prefill_budget_vllm_would_refuse_is_refused(
    staff: Any, pools: dict[str, GpuPool], llama_8b: Model, budget: object, problem: str
) -> None:
    response = _deploy_with_budget(staff, approved_version(llama_8b, "v1", "bf16"), budget)
    assert response.status_code == 400
    assert problem in " ".join(response.json()["engine_args"])
    assert not Deployment.objects.exists()


@pytest.mark.parametrize(
    ("pool", "budget", "launched"),
    [
        ("l4", 512, 512),
        # The platform's choice for the standard tier's 100 ms: the largest chunk whose step
        # with a decode batch fits (an H100's 2048 is 56 ms, its 4096 113 ms); on an L4 even
        # 512 outlasts it (112 ms), so the smallest, 256.
        ("h100", None, 2048),
        ("l4", None, 256),
    ],
)
def test_a_prefill_budget_is_kept_and_null_leaves_the_choice_to_the_platform(
    staff: Any,
    pools: dict[str, GpuPool],
    llama_8b: Model,
    pool: str,
    budget: int | None,
    launched: int,
) -> None:
    version = approved_version(llama_8b, "v1", "bf16")
    response = _deploy_with_budget(staff, version, budget, pools[pool].name)
    assert response.status_code == 201, response.json()
    answer = response.json()
    assert answer["effective_engine_args"]["max_num_batched_tokens"] == budget
    deployment = Deployment.objects.get(pk=answer["id"])
    assert deployment.slo_tier == "standard"
    # What reconcile launches with (the routing table test covers the other tiers).
    assert launch_budget(deployment, deployment.effective_engine_args(), "bf16") == launched


def test_a_tenant_member_cannot_create_a_deployment(
    acme_user: Any, pools: dict[str, GpuPool], llama_8b: Model
) -> None:
    version = approved_version(llama_8b, "v1", "bf16")
    response = client_for(acme_user).post(
        "/api/v1/deployments/",
        {"model_version": version.pk, "pool": "l4-us-east"},
        format="json",
    )
    assert response.status_code == 403


def test_a_disaggregated_deployment_is_created_with_both_pools_through_the_api(
    staff: Any, pools: dict[str, GpuPool], llama_8b: Model
) -> None:
    version = approved_version(llama_8b, "v-pd", "bf16")
    body = {
        "model_version": version.pk,
        "pool": pools["h100"].name,
        "decode_pool": pools["h200"].name,
        "kv_connector": "nixl",
        "decode_replicas_max": 4,
        "decode_replicas_desired": 2,
        "engine_args": {},
    }
    response = client_for(staff).post("/api/v1/deployments/", body, format="json")
    assert response.status_code == 201, response.json()
    answer = response.json()
    assert (answer["decode_pool"], answer["decode_replicas_desired"]) == ("h200-us-east", 2)
    assert Deployment.objects.get(pk=answer["id"]).disaggregated
    # A decode pool without a connector: a 400 on the field, nothing created.
    before = Deployment.objects.count()
    response = client_for(staff).post(
        "/api/v1/deployments/", {**body, "kv_connector": ""}, format="json"
    )
    assert response.status_code == 400
    assert "needs a KV connector" in " ".join(response.json()["kv_connector"])
    assert Deployment.objects.count() == before
