"""Demo registry: the seven models of models.csv, an approved v1 of each (fp8 from 70B up),
an approved v2 of qwen2.5-7b ready to roll out, a model restricted to acme, and LoRA
adapters (one public, one owned by acme). Deployments come with the demo fleet's pools.

Every row is written through registry.actions, so the demo passes the checks an API caller
does; a second seed changes nothing."""

from __future__ import annotations

from typing import Any

from registry.actions import (
    do_create_adapter,
    do_create_model,
    do_create_version,
    do_update_model,
    publish_visibility,
)
from registry.models import Adapter, Model, ModelVersion, Visibility
from serving.engine.specs import ModelSpec, load_model_specs
from tenants.models import Tenant

ARTIFACTS = {
    "llama-3.2-1b": "hf://meta-llama/Llama-3.2-1B-Instruct",
    "qwen2.5-7b": "hf://Qwen/Qwen2.5-7B-Instruct",
    "llama-3.1-8b": "hf://meta-llama/Llama-3.1-8B-Instruct",
    "mistral-7b-v0.3": "hf://mistralai/Mistral-7B-Instruct-v0.3",
    "llama-3.1-70b": "hf://meta-llama/Llama-3.1-70B-Instruct",
    "qwen2.5-72b": "hf://Qwen/Qwen2.5-72B-Instruct",
    "llama-3.1-405b": "hf://meta-llama/Llama-3.1-405B-Instruct-FP8",
}
# Granted to acme only: shows a model globex never sees.
RESTRICTED_TO_ACME = "qwen2.5-72b"


def model_fields(spec: ModelSpec) -> dict[str, Any]:
    """A Model row's architecture figures from a models.csv row."""
    return {
        "family": spec.name.split("-")[0],
        "params_b": spec.params_b,
        "layers": spec.layers,
        "hidden": spec.hidden,
        "kv_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "max_context": spec.max_context,
    }


def put_model(name: str, fields: dict[str, Any], *, grant: Tenant | None = None) -> Model:
    """The model `name` with these figures, created or brought back to them; `grant` is
    added to whom it is granted to (grants made since the last seed stay)."""
    model = Model.objects.filter(name=name).first()
    grants = None
    if grant is not None:
        kept = [] if model is None else list(model.granted_tenants.values_list("pk", flat=True))
        grants = [*kept, grant.pk]
    if model is None:
        return do_create_model(name=name, granted_tenant_ids=grants, **fields)
    return do_update_model(model, granted_tenant_ids=grants, **fields)


def put_approved_version(model: Model, version: str, **fields: Any) -> ModelVersion:
    """The approved `version` of `model`, registered with `fields` unless it exists (an
    approved version's artifact never changes: a new artifact is a new version)."""
    existing = ModelVersion.objects.filter(model=model, version=version).first()
    return existing or do_create_version(
        model, version=version, status=ModelVersion.Status.APPROVED, **fields
    )


def seed(details: dict[str, Any]) -> None:
    acme = Tenant.objects.filter(slug="acme").first()
    for name, spec in load_model_specs().items():
        restricted = name == RESTRICTED_TO_ACME
        model = put_model(
            name,
            {
                **model_fields(spec),
                "visibility": Visibility.RESTRICTED if restricted else Visibility.PUBLIC,
            },
            grant=acme if restricted else None,
        )
        put_approved_version(
            model,
            "v1",
            artifact_uri=ARTIFACTS[name],
            quantization="fp8" if spec.params_b >= 70 else "bf16",
        )
    v1 = ModelVersion.objects.get(model__name="llama-3.1-8b", version="v1")
    # A second version to roll out. qwen2.5-7b, because the demo serves it from one
    # deployment, so its rollout moves all of its traffic (llama-3.1-8b runs on two pools in
    # the demo and would roll out pool by pool).
    qwen = Model.objects.get(name="qwen2.5-7b")
    put_approved_version(qwen, "v2", artifact_uri=ARTIFACTS["qwen2.5-7b"], revision="main")
    if not Adapter.objects.filter(name="llama-3.1-8b-sql").exists():
        do_create_adapter(
            name="llama-3.1-8b-sql",
            base_version=v1,
            rank=16,
            artifact_uri="s3://demo-adapters/llama-3.1-8b-sql/",
            visibility=Visibility.PUBLIC,
        )
    if acme is not None and not Adapter.objects.filter(name="acme-support-tone").exists():
        do_create_adapter(
            name="acme-support-tone",
            base_version=v1,
            rank=8,
            artifact_uri="s3://demo-adapters/acme-support-tone/",
            owner_tenant=acme,
            visibility=Visibility.RESTRICTED,
        )
    try:
        publish_visibility()
    except Exception as error:  # a seed without Redis still leaves a usable database
        details.setdefault("warnings", []).append(f"model visibility not published: {error}")
    # The banner's rollout to try is serving.demo's to write: it knows the deployment.
