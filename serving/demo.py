"""The demo fleet: four pools in two regions, a stable join token per pool (long-lived and
multi-use, unlike the expiring ones real pools get), simulated nodes,
and (when the registry's demo has not put any on these pools) deployments of three models.

With PLATFORM_DEMO_ENGINE=vllm a fifth pool joins: one CPU node whose agent runs real vLLM
(its CPU build) serving the tiny model that scripts/build_tiny_model.py builds, as
`demo-tiny`, with one LoRA adapter, `demo-tiny-pirate`.

Pools go through serving.actions.pools, models, versions, adapters and deployments through
registry.actions: the demo passes the checks an API caller does."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings

from registry.actions import (
    do_create_adapter,
    do_create_deployment,
    do_create_model,
    do_update_adapter,
    publish_visibility,
)
from registry.demo import model_fields, put_approved_version, put_model
from registry.models import Adapter, Deployment, Model, ModelVersion, Visibility
from serving.actions.credentials import do_create_join_token, hash_token
from serving.actions.pools import do_create_pool, do_update_pool
from serving.engine.specs import load_model_specs
from serving.models import GpuClass, GpuPool, JoinToken


@dataclass(frozen=True)
class DemoPool:
    name: str
    gpu_class: str
    region: str
    usd_per_gpu_hour: Decimal | None
    nodes: int
    gpus_per_node: int


DEMO_POOLS: tuple[DemoPool, ...] = (
    DemoPool("h100-us-east", "H100-SXM-80GB", "us-east", None, 1, 2),
    # Two GPUs: room for the canary of the rollout the banner suggests (qwen2.5-7b v1 -> v2)
    # beside its baseline, so that rollout can run to promotion.
    DemoPool("a100-us-east", "A100-SXM-80GB", "us-east", None, 1, 2),
    DemoPool("l40s-eu-west", "L40S-48GB", "eu-west", None, 1, 1),
    DemoPool("l4-eu-west", "L4-24GB", "eu-west", Decimal("0.7000"), 2, 1),
)

CPU_POOL = DemoPool("cpu-local", "CPU-X86-2C", "local", None, 1, 1)
TINY_MODEL = "demo-tiny"
TINY_ADAPTER = "demo-tiny-pirate"
# The tiny Llama of scripts/build_tiny_model.py: 2 layers, hidden 256, 2 KV heads of 64.
TINY_ARCHITECTURE: dict[str, Any] = {
    "family": "llama",
    "params_b": 0.01,  # 3.7 M parameters; the registry's smallest figure
    "layers": 2,
    "hidden": 256,
    "kv_heads": 2,
    "head_dim": 64,
    "max_context": 4096,
}
TINY_ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 4096,
    "max_num_seqs": 16,
    "enable_lora": True,
    "max_loras": 2,
    "max_lora_rank": 8,
}


def demo_pools() -> tuple[DemoPool, ...]:
    return (*DEMO_POOLS, CPU_POOL) if settings.PLATFORM_DEMO_ENGINE == "vllm" else DEMO_POOLS


def var_dir() -> Path:
    return settings.PLATFORM_VAR_DIR


def tiny_model_dir() -> Path:
    """Where `make run` builds the tiny model (base/ and adapters/ inside)."""
    return var_dir() / "models" / "tiny-llama"


# (served name = models.csv row, artifact, quantization, pool, TP): three models, four pools.
DEMO_DEPLOYMENTS: tuple[tuple[str, str, str, str, int], ...] = (
    ("llama-3.1-70b", "hf://meta-llama/Llama-3.1-70B-Instruct", "fp8", "h100-us-east", 2),
    ("qwen2.5-7b", "hf://Qwen/Qwen2.5-7B-Instruct", "bf16", "a100-us-east", 1),
    ("llama-3.1-8b", "hf://meta-llama/Llama-3.1-8B-Instruct", "bf16", "l40s-eu-west", 1),
    ("llama-3.1-8b", "hf://meta-llama/Llama-3.1-8B-Instruct", "bf16", "l4-eu-west", 1),
)


def seed(details: dict[str, Any]) -> None:
    fleet = details.setdefault("fleet", {})
    tokens: dict[str, str] = fleet.setdefault("join_tokens", {})
    for demo in demo_pools():
        pool = _put_pool(demo)
        secret = tokens.get(demo.name) or "jt_demo_" + os.urandom(16).hex()
        tokens[demo.name] = secret
        if not JoinToken.objects.filter(token_hash=hash_token(secret)).exists():
            # The demo's agents come back with every `make run`, from the token saved in
            # var/demo.json: it never expires and admits any number of nodes. Real pools
            # get expiring, single-use ones (POST /api/v1/join-tokens/).
            do_create_join_token(pool, name="demo", ttl=None, secret=secret)
    details["extra"]["Join token (L4 pool)"] = (
        f"{tokens['l4-eu-west']} (demo only: never expires, any number of nodes)"
    )
    _seed_deployments()
    _suggest_rollout(details)
    if settings.PLATFORM_DEMO_ENGINE == "vllm":
        seed_tiny_model(tiny_model_dir(), CPU_POOL.name)
        details["extra"]["Real vLLM model"] = f"{TINY_MODEL} (adapter {TINY_ADAPTER}), CPU node"


# A rollout the demo's traffic (about 1 request/s over every model) carries to promotion in a
# few minutes: two steps, each held a minute and judged on 10 canary requests. The defaults
# (5, 25, 50, 100 % over 5 minutes and 200 requests a step) are for production traffic.
DEMO_ROLLOUT: dict[str, Any] = {
    "steps": [50, 100],
    "step_min_duration_s": 60,
    "step_min_requests": 10,
    "gate_thresholds": {"min_requests": 10},
}


def _suggest_rollout(details: dict[str, Any]) -> None:
    """The banner's "Rollout to try": qwen2.5-7b's active deployment to a newer approved
    version nothing serves yet, with its ids; none once no such version is left (after the
    promotion)."""
    details["extra"].pop("Rollout to try", None)
    baseline = (
        Deployment.objects.filter(
            model_version__model__name="qwen2.5-7b",
            status=Deployment.Status.ACTIVE,
            pool__name__in=[p.name for p in DEMO_POOLS],
        )
        .select_related("model_version")
        .first()
    )
    if baseline is None:
        return
    target = (
        ModelVersion.objects.filter(
            model=baseline.model_version.model, status=ModelVersion.Status.APPROVED
        )
        .filter(created_at__gt=baseline.model_version.created_at)  # forward, not back
        .exclude(deployments__status=Deployment.Status.ACTIVE)
        .order_by("-created_at")
        .first()
    )
    if target is None:
        return
    body = {"baseline": baseline.pk, "target_version": target.pk, **DEMO_ROLLOUT}
    details["extra"]["Rollout to try"] = (
        f"qwen2.5-7b {baseline.model_version.version} -> {target.version}, promoted in about "
        f"5 minutes of demo traffic: POST /api/v1/rollouts/ {json.dumps(body)} "
        "with the staff API token (README: Trying it)"
    )


def _put_pool(demo: DemoPool) -> GpuPool:
    fields = {
        "gpu_class": GpuClass.objects.get(name=demo.gpu_class),
        "region": demo.region,
        "usd_per_gpu_hour": demo.usd_per_gpu_hour,
        "labels": {"demo": "true"},
    }
    pool = GpuPool.objects.filter(name=demo.name).first()
    if pool is None:
        return do_create_pool(name=demo.name, **fields)
    return do_update_pool(pool, **fields)


def seed_tiny_model(directory: Path, pool_name: str) -> Deployment:
    """The tiny model, its adapter and its deployment on `pool_name`, all public; returns the
    deployment. The registry refers to the built directory by its file:// URI (an existing v1
    keeps its URI: an approved version's artifact never changes)."""
    model = put_model(TINY_MODEL, {**TINY_ARCHITECTURE, "visibility": Visibility.PUBLIC})
    version = put_approved_version(
        model, "v1", artifact_uri=(directory / "base").resolve().as_uri(), quantization="bf16"
    )
    adapter_fields: dict[str, Any] = {
        "base_version": version,
        "rank": 8,
        "artifact_uri": (directory / "adapters" / TINY_ADAPTER).resolve().as_uri(),
        "visibility": Visibility.PUBLIC,
    }
    adapter = Adapter.objects.filter(name=TINY_ADAPTER).first()
    if adapter is None:
        do_create_adapter(name=TINY_ADAPTER, **adapter_fields)
    else:
        do_update_adapter(adapter, **adapter_fields)
    publish_visibility()
    name = _deployment_name(TINY_MODEL, pool_name)
    existing = Deployment.objects.filter(name=name).first()
    if existing is not None:
        return existing
    return do_create_deployment(
        name=name,
        model_version=version,
        pool=GpuPool.objects.get(name=pool_name),
        tensor_parallel=1,
        engine_args=TINY_ENGINE_ARGS,
    )


def _seed_deployments() -> None:
    """Deployments on the demo pools, unless the registry's demo already made some."""
    if Deployment.objects.filter(pool__name__in=[p.name for p in DEMO_POOLS]).exists():
        return
    specs = load_model_specs()
    for served, artifact, quantization, pool_name, tp in DEMO_DEPLOYMENTS:
        model = Model.objects.filter(name=served).first() or do_create_model(
            name=served, **model_fields(specs[served])
        )
        version = put_approved_version(
            model, "v1", artifact_uri=artifact, quantization=quantization
        )
        if not Deployment.objects.filter(name=_deployment_name(served, pool_name)).exists():
            # Through the registry's write path, so its placement check vets the demo too.
            do_create_deployment(
                name=_deployment_name(served, pool_name),
                model_version=version,
                pool=GpuPool.objects.get(name=pool_name),
                tensor_parallel=tp,
                engine_args={"max_model_len": 8192, "max_num_seqs": 64},
            )


def _deployment_name(served: str, pool_name: str) -> str:
    return f"{served}-{pool_name}".replace(".", "-")


def agent_commands(details: dict[str, Any], control_plane: str) -> list[dict[str, Any]]:
    """One node agent per demo node, as argv lists `make run` starts as child processes."""
    tokens = details.get("fleet", {}).get("join_tokens", {})
    state_root = var_dir() / "agents"
    commands = []
    for demo in demo_pools():
        if demo.name not in tokens:
            continue
        short = demo.name.split("-")[0]
        for number in range(1, demo.nodes + 1):
            name = f"agent-{short}-{number}"
            commands.append(
                {
                    "name": name,
                    "argv": [
                        sys.executable,
                        "-m",
                        "serving.agent",
                        "--control-plane",
                        control_plane,
                        "--token",
                        tokens[demo.name],
                        *_node_kind(demo),
                        "--node-name",
                        name,
                        "--state-dir",
                        str(state_root / name),
                    ],
                }
            )
    return commands


def _node_kind(demo: DemoPool) -> list[str]:
    if demo is CPU_POOL:
        # vLLM's CPU build loads in 25 to 75 s on two cores: give it time.
        return [
            "--cpu-slots",
            str(demo.gpus_per_node),
            "--vllm-python",
            settings.VLLM_PYTHON,
            "--ready-timeout",
            "600",
        ]
    return ["--simulate-gpus", f"{demo.gpu_class}:{demo.gpus_per_node}", "--sim-time-scale", "1"]
