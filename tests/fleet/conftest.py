"""Fleet fixtures: GPU classes, pools with join tokens, deployments, and agent-side helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import pytest
from django.test import Client
from pytest_django import Settings

from serving.actions import credentials
from serving.actions.gpu_classes import sync_gpu_classes
from serving.models import GpuClass, GpuPool

if TYPE_CHECKING:
    from registry.models import Deployment


class MakePool(Protocol):
    """The `make_pool` fixture: a pool and the secret of its join token."""

    def __call__(
        self, name: str = ..., gpu_class: str = ..., region: str = ...
    ) -> tuple[GpuPool, str]: ...


class MakeDeployment(Protocol):
    """The `make_deployment` fixture: an approved version of `model`, deployed on `pool`."""

    def __call__(
        self,
        pool: GpuPool,
        model: str = ...,
        quantization: str = ...,
        tensor_parallel: int = ...,
        replicas: int = ...,
        weight: int = ...,
        version: str = ...,
        **engine_args: Any,
    ) -> Deployment: ...


class RegisteredNode(TypedDict):
    """The agent API's answer to a registration."""

    node_id: int
    node_token: str
    heartbeat_interval_s: int


class Register(Protocol):
    """The `register` fixture: `gpus` GPUs named by the keyword arguments of `gpu_inventory`."""

    def __call__(
        self, secret: str, hostname: str, gpus: int = ..., **kwargs: Any
    ) -> RegisteredNode: ...


@pytest.fixture(autouse=True)
def _agent_routes(settings: Settings) -> None:
    settings.ROOT_URLCONF = "tests.fleet.urls"


@pytest.fixture
def gpu_classes(db: None) -> None:
    # With --nomigrations the data migration has not run; syncing twice changes nothing.
    sync_gpu_classes(GpuClass)


@pytest.fixture
def make_pool(gpu_classes: None) -> MakePool:
    def make(
        name: str = "l4-eu", gpu_class: str = "L4-24GB", region: str = "eu-west"
    ) -> tuple[GpuPool, str]:
        pool = GpuPool.objects.create(
            name=name, gpu_class=GpuClass.objects.get(name=gpu_class), region=region
        )
        _, secret = credentials.do_create_join_token(pool, name="test")
        return pool, secret

    return make


@pytest.fixture
def make_deployment(db: None) -> MakeDeployment:
    from registry.models import Deployment, Model, ModelVersion
    from serving.engine.specs import load_model_specs

    def make(
        pool: GpuPool,
        model: str = "llama-3.1-8b",
        quantization: str = "bf16",
        tensor_parallel: int = 1,
        replicas: int = 1,
        weight: int = 100,
        version: str = "v1",
        **engine_args: Any,
    ) -> Deployment:
        spec = load_model_specs()[model]
        row, _ = Model.objects.get_or_create(
            name=model,
            defaults={
                "family": model.split("-")[0],
                "params_b": spec.params_b,
                "layers": spec.layers,
                "hidden": spec.hidden,
                "kv_heads": spec.kv_heads,
                "head_dim": spec.head_dim,
                "max_context": spec.max_context,
            },
        )
        model_version, _ = ModelVersion.objects.get_or_create(
            model=row,
            version=version,
            defaults={
                "artifact_uri": f"hf://org/{model}",
                "quantization": quantization,
                "status": ModelVersion.Status.APPROVED,
            },
        )
        return Deployment.objects.create(
            name=f"{model}-{version}-{pool.name}".replace(".", "-"),
            model_version=model_version,
            pool=pool,
            tensor_parallel=tensor_parallel,
            replicas_min=0,
            replicas_max=max(replicas, 8),
            replicas_desired=replicas,
            traffic_weight=weight,
            engine_args={"max_model_len": 4096, "max_num_seqs": 32, **engine_args},
        )

    return make


def gpu_inventory(
    count: int, name: str = "L4-24GB", memory_mb: int = 23034
) -> list[dict[str, Any]]:
    return [
        {"index": i, "uuid": f"GPU-{name}-{i}", "name": name, "memory_mb": memory_mb}
        for i in range(count)
    ]


@pytest.fixture
def register(db: None) -> Register:
    """Register a node through the agent API, as an agent would."""

    def do(secret: str, hostname: str, gpus: int = 2, **kwargs: Any) -> RegisteredNode:
        response = Client().post(
            "/api/agent/v1/register",
            {
                "join_token": secret,
                "hostname": hostname,
                "agent_url": f"http://{hostname}.local:9100",
                "gpus": gpu_inventory(gpus, **kwargs),
            },
            content_type="application/json",
        )
        assert response.status_code == 200, response.content
        node: RegisteredNode = response.json()
        return node

    return do


def send_heartbeat(node: RegisteredNode, **body: Any) -> Any:
    return Client().post(
        "/api/agent/v1/heartbeat",
        {
            "node_id": node["node_id"],
            "sent_at": 0,
            "gpus": [],
            "replicas": [],
            "events": [],
            **body,
        },
        content_type="application/json",
        headers={"authorization": f"Bearer {node['node_token']}"},
    )


def replica_report(
    replica_id: str, state: str = "Ready", port: int = 18001, **extra: Any
) -> dict[str, Any]:
    return {
        "replica_id": replica_id,
        "state": state,
        "pid": 4242,
        "port": port,
        "restarts": 0,
        "last_error": "",
        "started_at": 1_700_000_000.0,
        "ready_at": 1_700_000_005.0 if state == "Ready" else None,
        **extra,
    }
