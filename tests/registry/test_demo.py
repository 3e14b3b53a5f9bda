"""The registry's demo seed: the seven catalogue models, idempotent."""

from __future__ import annotations

from typing import Any

import redis

from registry import demo
from registry.models import Adapter, Model, ModelVersion, Visibility
from serving.engine.specs import load_model_specs
from tenants.models import Tenant


def test_the_demo_seeds_every_catalogue_model_once(acme: Tenant, redis_client: redis.Redis) -> None:
    details: dict[str, Any] = {"extra": {}}
    demo.seed(details)
    demo.seed(details)
    assert set(Model.objects.values_list("name", flat=True)) == set(load_model_specs())
    assert ModelVersion.objects.filter(status="approved").count() == len(load_model_specs()) + 1
    assert Model.objects.get(name=demo.RESTRICTED_TO_ACME).visibility == Visibility.RESTRICTED
    assert Adapter.objects.get(name="acme-support-tone").owner_tenant == acme
    assert redis_client.hlen("registry:visibility") == Model.objects.count() + 2


def test_seeded_architecture_figures_match_the_catalogue(db: Any, redis_client: Any) -> None:
    demo.seed({"extra": {}})
    for name, spec in load_model_specs().items():
        row = Model.objects.get(name=name)
        assert row.spec() == spec
