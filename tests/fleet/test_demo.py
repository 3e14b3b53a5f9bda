"""The fleet's demo seed: pools, join tokens and deployments, the same rows run after run."""

from __future__ import annotations

from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from pytest_django import Settings

from registry.models import Adapter, Deployment, Model, ModelVersion, Visibility
from serving import demo
from serving.actions.credentials import hash_token
from serving.engine.specs import load_model_specs
from serving.models import GpuClass, GpuPool, JoinToken

pytestmark = pytest.mark.django_db


def _fleet_rows() -> dict[str, Any]:
    return {
        "pools": {
            p.name: (p.gpu_class.name, p.region, p.usd_per_gpu_hour, p.spot, p.labels)
            for p in GpuPool.objects.select_related("gpu_class")
        },
        "tokens": sorted(JoinToken.objects.values_list("pool__name", "name", "token_hash")),
        "deployments": {
            d.name: (
                str(d.model_version),
                d.model_version.artifact_uri,
                d.model_version.quantization,
                d.model_version.status,
                d.pool.name,
                d.tensor_parallel,
                d.engine_args,
                d.replicas_min,
                d.replicas_desired,
                d.replicas_max,
                d.status,
                d.traffic_weight,
            )
            for d in Deployment.objects.select_related("model_version__model", "pool")
        },
        "models": {m.name: (m.family, m.spec(), m.visibility) for m in Model.objects.all()},
    }


def test_the_demo_fleet_has_its_four_pools_their_tokens_and_three_models_on_them(
    gpu_classes: None,
) -> None:
    details: dict[str, Any] = {"extra": {}}
    demo.seed(details)
    rows = _fleet_rows()
    assert rows["pools"] == {
        "h100-us-east": ("H100-SXM-80GB", "us-east", None, False, {"demo": "true"}),
        "a100-us-east": ("A100-SXM-80GB", "us-east", None, False, {"demo": "true"}),
        "l40s-eu-west": ("L40S-48GB", "eu-west", None, False, {"demo": "true"}),
        "l4-eu-west": ("L4-24GB", "eu-west", Decimal("0.7000"), False, {"demo": "true"}),
    }
    tokens = details["fleet"]["join_tokens"]
    assert rows["tokens"] == sorted((pool, "demo", hash_token(tokens[pool])) for pool in tokens)
    engine_args = {"max_model_len": 8192, "max_num_seqs": 64}
    assert rows["deployments"] == {
        "llama-3-1-70b-h100-us-east": (
            "llama-3.1-70b@v1",
            "hf://meta-llama/Llama-3.1-70B-Instruct",
            "fp8",
            "approved",
            "h100-us-east",
            2,
            engine_args,
            1,
            1,
            1,
            "active",
            100,
        ),
        "qwen2-5-7b-a100-us-east": (
            "qwen2.5-7b@v1",
            "hf://Qwen/Qwen2.5-7B-Instruct",
            "bf16",
            "approved",
            "a100-us-east",
            1,
            engine_args,
            1,
            1,
            1,
            "active",
            100,
        ),
        "llama-3-1-8b-l40s-eu-west": (
            "llama-3.1-8b@v1",
            "hf://meta-llama/Llama-3.1-8B-Instruct",
            "bf16",
            "approved",
            "l40s-eu-west",
            1,
            engine_args,
            1,
            1,
            1,
            "active",
            100,
        ),
        "llama-3-1-8b-l4-eu-west": (
            "llama-3.1-8b@v1",
            "hf://meta-llama/Llama-3.1-8B-Instruct",
            "bf16",
            "approved",
            "l4-eu-west",
            1,
            engine_args,
            1,
            1,
            1,
            "active",
            100,
        ),
    }
    specs = load_model_specs()
    assert rows["models"] == {
        name: (name.split("-")[0], specs[name], Visibility.PUBLIC)
        for name in ("llama-3.1-70b", "qwen2.5-7b", "llama-3.1-8b")
    }


def test_a_second_fleet_seed_changes_no_row_and_keeps_the_join_tokens(
    gpu_classes: None,
) -> None:
    details: dict[str, Any] = {"extra": {}}
    demo.seed(details)
    first, tokens = _fleet_rows(), dict(details["fleet"]["join_tokens"])
    demo.seed(details)
    assert _fleet_rows() == first
    assert details["fleet"]["join_tokens"] == tokens


def test_a_seed_puts_a_demo_pools_price_back(gpu_classes: None) -> None:
    demo.seed({"extra": {}})
    GpuPool.objects.filter(name="l4-eu-west").update(usd_per_gpu_hour=Decimal("9"), region="x")
    demo.seed({"extra": {}})
    pool = GpuPool.objects.get(name="l4-eu-west")
    assert (pool.usd_per_gpu_hour, pool.region) == (Decimal("0.7000"), "eu-west")


def test_the_tiny_model_is_seeded_public_on_the_cpu_pool_once(
    gpu_classes: None, tmp_path: Path, settings: Settings
) -> None:
    settings.PLATFORM_MODEL_ROOT = tmp_path  # file:// artifacts must lie inside it
    GpuPool.objects.create(
        name="cpu-local", gpu_class=GpuClass.objects.get(name="CPU-X86-2C"), region="local"
    )
    deployment = demo.seed_tiny_model(tmp_path, "cpu-local")
    assert demo.seed_tiny_model(tmp_path, "cpu-local").pk == deployment.pk
    version = ModelVersion.objects.get(model__name=demo.TINY_MODEL)
    assert (version.version, version.artifact_uri, version.quantization, version.status) == (
        "v1",
        (tmp_path / "base").resolve().as_uri(),
        "bf16",
        "approved",
    )
    model = version.model
    assert (model.visibility, model.params_b, model.layers) == (Visibility.PUBLIC, 0.01, 2)
    adapter = Adapter.objects.get(name=demo.TINY_ADAPTER)
    assert (adapter.base_version_id, adapter.rank, adapter.visibility) == (
        version.pk,
        8,
        Visibility.PUBLIC,
    )
    assert adapter.artifact_uri == (tmp_path / "adapters" / demo.TINY_ADAPTER).resolve().as_uri()
    assert (deployment.name, deployment.model_version_id, deployment.engine_args) == (
        "demo-tiny-cpu-local",
        version.pk,
        demo.TINY_ENGINE_ARGS,
    )
    assert Deployment.objects.count() == 1


def test_the_whole_demo_seeds_in_order_and_a_second_run_changes_no_row(
    gpu_classes: None, tmp_path: Path, settings: Settings, redis_client: Any
) -> None:
    settings.PLATFORM_VAR_DIR = tmp_path
    call_command("seed_demo", stdout=StringIO())
    first = _fleet_rows()
    call_command("seed_demo", stdout=StringIO())
    assert _fleet_rows() == first
    # The registry's demo ran first: its catalogue, and the fleet's deployments on its v1s.
    assert Model.objects.count() == len(load_model_specs())
    assert len(first["deployments"]) == len(demo.DEMO_DEPLOYMENTS)
    assert Adapter.objects.filter(owner_tenant__slug="acme").count() == 1
