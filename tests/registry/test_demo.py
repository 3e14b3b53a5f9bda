"""The registry's demo seed: the seven catalogue models, idempotent."""

from __future__ import annotations

from typing import Any

import redis

from registry import demo
from registry.models import Adapter, Model, ModelVersion, Visibility
from serving.engine.specs import load_model_specs
from serving.redis_contracts import VISIBILITY_HASH
from tenants.models import Tenant


def test_the_demo_seeds_every_catalogue_model_once(acme: Tenant, redis_client: redis.Redis) -> None:
    details: dict[str, Any] = {"extra": {}}
    demo.seed(details)
    demo.seed(details)
    assert set(Model.objects.values_list("name", flat=True)) == set(load_model_specs())
    assert ModelVersion.objects.filter(status="approved").count() == len(load_model_specs()) + 1
    assert Model.objects.get(name=demo.RESTRICTED_TO_ACME).visibility == Visibility.RESTRICTED
    assert Adapter.objects.get(name="acme-support-tone").owner_tenant == acme
    assert redis_client.hlen(VISIBILITY_HASH) == Model.objects.count() + 2


def test_seeded_architecture_figures_match_the_catalogue(db: Any, redis_client: Any) -> None:
    demo.seed({"extra": {}})
    for name, spec in load_model_specs().items():
        row = Model.objects.get(name=name)
        assert row.spec() == spec


def _registry_rows() -> dict[str, Any]:
    """Every row the registry's demo writes, as plain data, to compare two seeds by."""
    return {
        "models": {
            m.name: (
                m.family,
                m.description,
                m.params_b,
                m.layers,
                m.hidden,
                m.kv_heads,
                m.head_dim,
                m.max_context,
                m.visibility,
                sorted(m.granted_tenants.values_list("slug", flat=True)),
            )
            for m in Model.objects.all()
        },
        "versions": {
            str(v): (
                v.artifact_uri,
                v.revision,
                v.quantization,
                v.status,
                v.approved_by_id,
                v.approved_at,
            )
            for v in ModelVersion.objects.select_related("model")
        },
        "adapters": {
            a.name: (
                str(a.base_version),
                a.rank,
                a.artifact_uri,
                a.owner_tenant.slug if a.owner_tenant else None,
                a.visibility,
                sorted(a.granted_tenants.values_list("slug", flat=True)),
            )
            for a in Adapter.objects.select_related("base_version__model", "owner_tenant")
        },
    }


def test_the_demo_rows_are_the_catalogue_with_an_approved_v1_each(
    acme: Tenant, redis_client: redis.Redis
) -> None:
    demo.seed({"extra": {}})
    rows = _registry_rows()
    for name, spec in load_model_specs().items():
        fields = demo.model_fields(spec)
        restricted = name == demo.RESTRICTED_TO_ACME
        assert rows["models"][name] == (
            fields["family"],
            "",
            spec.params_b,
            spec.layers,
            spec.hidden,
            spec.kv_heads,
            spec.head_dim,
            spec.max_context,
            Visibility.RESTRICTED if restricted else Visibility.PUBLIC,
            ["acme"] if restricted else [],
        )
        quantization = "fp8" if spec.params_b >= 70 else "bf16"
        # Seeded already approved, by no one: there was no review to record.
        assert rows["versions"][f"{name}@v1"] == (
            demo.ARTIFACTS[name],
            "",
            quantization,
            "approved",
            None,
            None,
        )
    assert rows["versions"]["qwen2.5-7b@v2"] == (
        demo.ARTIFACTS["qwen2.5-7b"],
        "main",
        "bf16",
        "approved",
        None,
        None,
    )
    assert len(rows["versions"]) == len(load_model_specs()) + 1
    assert rows["adapters"] == {
        "llama-3.1-8b-sql": (
            "llama-3.1-8b@v1",
            16,
            "s3://demo-adapters/llama-3.1-8b-sql/",
            None,
            "public",
            [],
        ),
        "acme-support-tone": (
            "llama-3.1-8b@v1",
            8,
            "s3://demo-adapters/acme-support-tone/",
            "acme",
            "restricted",
            [],
        ),
    }


def test_a_second_seed_changes_no_row(acme: Tenant, redis_client: redis.Redis) -> None:
    demo.seed({"extra": {}})
    first = _registry_rows()
    demo.seed({"extra": {}})
    assert _registry_rows() == first


def test_a_seed_restores_a_models_figures_and_keeps_grants_made_since(
    acme: Tenant, redis_client: redis.Redis
) -> None:
    demo.seed({"extra": {}})
    globex = Tenant.objects.create(slug="globex", name="Globex")
    restricted = Model.objects.get(name=demo.RESTRICTED_TO_ACME)
    restricted.granted_tenants.add(globex)
    Model.objects.filter(name="llama-3.1-8b").update(
        max_context=1024, visibility=Visibility.RESTRICTED
    )
    demo.seed({"extra": {}})
    assert sorted(restricted.granted_tenants.values_list("slug", flat=True)) == ["acme", "globex"]
    llama = Model.objects.get(name="llama-3.1-8b")
    assert (llama.max_context, llama.visibility) == (
        load_model_specs()["llama-3.1-8b"].max_context,
        Visibility.PUBLIC,
    )
