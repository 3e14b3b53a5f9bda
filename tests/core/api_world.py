"""A small world for the REST API's fuzzer and its regression tests: acme (with an admin)
and globex, staff, a GPU pool with a node, a GPU, a replica and a join token, a model with an
approved version, a deployment and an adapter, an API key, a price sheet and an invoice."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

from django.contrib.auth import get_user_model

from metering.actions import do_close_month, do_create_price_sheet
from registry.actions import do_create_adapter, do_create_deployment
from serving.actions import credentials
from serving.actions.gpu_classes import sync_gpu_classes
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from tenants.actions import do_create_api_key, do_create_tenant
from tenants.models import Membership, Role, Scope, Tenant
from tests.registry.conftest import approved_version, make_model


@dataclass(frozen=True)
class World:
    acme: Tenant
    staff: Any
    admin: Any
    # The id of one row of each resource, by the name of its route (`models`, `keys`, ...).
    ids: dict[str, int]


def build_world() -> World:
    sync_gpu_classes(GpuClass)
    acme = do_create_tenant("acme", "Acme")
    do_create_tenant("globex", "Globex")
    users = get_user_model().objects
    staff = users.create_user("ops", is_staff=True)
    admin = users.create_user("acme-admin")
    users.create_user("nobody")
    membership = Membership.objects.create(user=admin, tenant=acme, role=Role.ADMIN)
    pool = GpuPool.objects.create(
        name="h100-us-east",
        gpu_class=GpuClass.objects.get(name="H100-SXM-80GB"),
        region="us-east",
    )
    token, _ = credentials.do_create_join_token(pool, name="fuzz")
    model = make_model("llama-3.1-8b")
    version = approved_version(model, "v1", "bf16")
    deployment = do_create_deployment(model_version=version, pool=pool, name="llama-8b")
    adapter = do_create_adapter(
        name="acme-support", base_version=version, rank=16, artifact_uri="hf://acme/support"
    )
    node = Node.objects.create(pool=pool, hostname="gpu-1", agent_url="http://10.0.0.1:9000")
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-1", name="H100", memory_mb=81559)
    replica = Replica.objects.create(deployment=deployment, node=node, gpu_indices=[0])
    key, _ = do_create_api_key(acme, "ci", admin, [Scope.INFERENCE], (), None)
    sheet = do_create_price_sheet(
        staff,
        model="llama-3.1-8b",
        input_usd_per_mtok=Decimal("0.1"),
        cached_input_usd_per_mtok=Decimal("0.05"),
        output_usd_per_mtok=Decimal("0.2"),
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    )
    invoice = do_close_month(acme, date(2026, 1, 1))
    ids = {
        "models": model.pk,
        "versions": version.pk,
        "adapters": adapter.pk,
        "deployments": deployment.pk,
        "pools": pool.pk,
        "join-tokens": token.pk,
        "nodes": node.pk,
        "gpus": gpu.pk,
        "replicas": replica.pk,
        "price-sheets": sheet.pk,
        "members": membership.pk,
        "keys": key.pk,
        "invoices": invoice.pk,
    }
    return World(acme=acme, staff=staff, admin=admin, ids=ids)


def path_values(path: str, world: World) -> dict[str, Any]:
    """Real values for the parameters of an OpenAPI path template (acme, and a row's id);
    empty when the route's resource has no row in the world."""
    values: dict[str, Any] = {}
    for name in ("slug", "tenant_slug"):
        if f"{{{name}}}" in path:
            values[name] = world.acme.slug
    if "{id}" in path:
        resource = path.split("/{id}/")[0].rsplit("/", 1)[-1]
        if resource not in world.ids:
            return {}
        values["id"] = world.ids[resource]
    return values
