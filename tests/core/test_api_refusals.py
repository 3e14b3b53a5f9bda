"""Ordinary bad input on /api/v1/ is a 4xx in DRF's JSON format that changes nothing: each
cause the schema fuzzer (test_api_fuzz.py) found answering 500, tried directly."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from django.apps import apps
from rest_framework.test import APIClient

from registry.models import ModelVersion
from serving.models import GpuPool
from tenants.models import Membership
from tests.core.api_world import World, build_world

NUL = "bad\x00name"
FAR_FUTURE = "9999-12-31T23:59:59-01:00"


@pytest.fixture
def world(db: None, redis_client: Any) -> World:
    return build_world()


def client_for(user: Any) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


@pytest.fixture
def staff(world: World) -> APIClient:
    return client_for(world.staff)


@pytest.fixture
def admin(world: World) -> APIClient:
    return client_for(world.admin)


def snapshot() -> dict[str, list[dict[str, Any]]]:
    """Every row of the project's own apps, to show a refused request wrote nothing."""
    rows = {}
    for app in ("tenants", "registry", "serving", "metering"):
        for model in apps.get_app_config(app).get_models():
            rows[model._meta.label] = list(model._default_manager.order_by("pk").values())
    return rows


@pytest.fixture
def unchanged() -> Callable[[], None]:
    before = snapshot()

    def check() -> None:
        assert snapshot() == before

    return check


def json_error(response: Any, status: int) -> Any:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("application/json")
    return response.json()


def test_adding_a_member_without_a_role_is_a_400_naming_role(
    admin: APIClient, unchanged: Callable[[], None]
) -> None:
    response = admin.post("/api/v1/tenants/acme/members/", {"username": "nobody"}, format="json")
    assert "role" in json_error(response, 400)
    unchanged()


def test_adding_an_unknown_user_and_an_existing_member_answer_the_same(
    admin: APIClient, unchanged: Callable[[], None]
) -> None:
    url = "/api/v1/tenants/acme/members/"
    unknown = admin.post(url, {"username": "no-such-user", "role": "viewer"}, format="json")
    member = admin.post(url, {"username": "acme-admin", "role": "viewer"}, format="json")
    assert json_error(unknown, 400) == json_error(member, 400)
    assert list(json_error(unknown, 400)) == ["username"]
    unchanged()


def test_granting_ownership_is_refused_before_the_username_is_looked_up(
    admin: APIClient, unchanged: Callable[[], None]
) -> None:
    url = "/api/v1/tenants/acme/members/"
    unknown = admin.post(url, {"username": "no-such-user", "role": "owner"}, format="json")
    known = admin.post(url, {"username": "nobody", "role": "owner"}, format="json")
    assert json_error(unknown, 403) == json_error(known, 403)
    unchanged()


def test_adding_a_known_user_still_works(admin: APIClient, world: World) -> None:
    url = "/api/v1/tenants/acme/members/"
    response = admin.post(url, {"username": "nobody", "role": "viewer"}, format="json")
    assert response.status_code == 201
    assert Membership.objects.filter(tenant=world.acme, user__username="nobody").exists()


def test_a_tenant_put_with_its_own_slug_is_accepted(staff: APIClient) -> None:
    body = {"slug": "acme", "name": "Acme Corp", "status": "active"}
    response = staff.put("/api/v1/tenants/acme/", body, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["name"] == "Acme Corp"


def test_a_tenant_put_that_changes_the_slug_is_a_400_naming_slug(
    staff: APIClient, unchanged: Callable[[], None]
) -> None:
    body = {"slug": "acme-2", "name": "Acme Corp", "status": "active"}
    response = staff.put("/api/v1/tenants/acme/", body, format="json")
    assert "slug" in json_error(response, 400)
    unchanged()


def test_creating_a_tenant_with_null_regions_is_a_400_naming_the_field(
    staff: APIClient, unchanged: Callable[[], None]
) -> None:
    body = {"slug": "initech", "name": "Initech", "allowed_regions": None}
    response = staff.post("/api/v1/tenants/", body, format="json")
    assert "allowed_regions" in json_error(response, 400)
    unchanged()


def test_deleting_a_tenant_with_invoices_is_a_409(
    staff: APIClient, unchanged: Callable[[], None]
) -> None:
    body = json_error(staff.delete("/api/v1/tenants/acme/"), 409)
    assert "detail" in body
    unchanged()


def test_a_version_put_is_answered_not_a_type_error(
    staff: APIClient, world: World, unchanged: Callable[[], None]
) -> None:
    # The world's version is approved: a PUT is refused (a change is a new version).
    url = f"/api/v1/versions/{world.ids['versions']}/"
    body = {"model": world.ids["models"], "version": "v2", "artifact_uri": "hf://x/y"}
    json_error(staff.put(url, body, format="json"), 400)
    unchanged()


def test_a_draft_version_put_changes_it(staff: APIClient, world: World) -> None:
    model_id = world.ids["models"]
    created = staff.post(
        "/api/v1/versions/",
        {"model": model_id, "version": "v2", "artifact_uri": "hf://x/v2", "quantization": "bf16"},
        format="json",
    )
    assert created.status_code == 201, created.content
    url = f"/api/v1/versions/{created.json()['id']}/"
    body = {"model": model_id, "version": "v3", "artifact_uri": "hf://x/v3", "quantization": "bf16"}
    response = staff.put(url, body, format="json")
    assert response.status_code == 200, response.content
    assert ModelVersion.objects.get(pk=created.json()["id"]).version == "v3"


@pytest.mark.parametrize("parameter", ["limit", "offset"])
def test_a_page_size_or_offset_beyond_any_integer_is_a_400_naming_it(
    staff: APIClient, parameter: str
) -> None:
    response = staff.get(f"/api/v1/models/?{parameter}={10**30}")
    assert parameter in json_error(response, 400)


def test_a_huge_key_filter_is_a_400_naming_key(admin: APIClient) -> None:
    response = admin.get(f"/api/v1/tenants/acme/usage/events/?key={10**30}")
    assert "key" in json_error(response, 400)


def test_deleting_a_pool_in_use_is_refused_and_keeps_it(
    staff: APIClient, world: World, unchanged: Callable[[], None]
) -> None:
    response = staff.delete(f"/api/v1/pools/{world.ids['pools']}/")
    assert response.status_code in (400, 409)
    json_error(response, response.status_code)
    unchanged()


def test_options_on_the_quota_route_describes_it(admin: APIClient) -> None:
    response = admin.options("/api/v1/tenants/acme/quota/")
    assert response.status_code == 200
    assert response.json()["name"]


@pytest.mark.parametrize(
    ("url", "body", "field"),
    [
        ("/api/v1/pools/", {"name": NUL, "gpu_class": "H100-SXM-80GB", "region": "x"}, "name"),
        ("/api/v1/tenants/", {"slug": "initech", "name": NUL}, "name"),
        ("/api/v1/models/", {"name": "m", "family": NUL}, "family"),
        ("/api/v1/tenants/", {"slug": "initech", "name": "I", "blocked_patterns": [NUL]}, None),
    ],
)
def test_a_nul_byte_in_a_text_field_is_a_400_naming_the_field(
    staff: APIClient, unchanged: Callable[[], None], url: str, body: dict[str, Any], field: str
) -> None:
    errors = json_error(staff.post(url, body, format="json"), 400)
    assert (field or "blocked_patterns") in errors
    unchanged()


def test_a_nul_byte_in_a_query_parameter_is_a_400_naming_it(staff: APIClient) -> None:
    assert "name" in json_error(staff.get("/api/v1/models/?name=a%00b"), 400)


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/margin/?end={}",
        "/api/v1/margin/export.csv?start={}",
        "/api/v1/rollups/?end={}",
        "/api/v1/tenants/acme/rollups/?start={}",
        "/api/v1/tenants/acme/usage/?end={}",
        "/api/v1/price-sheets/?in_force_at={}",
    ],
)
@pytest.mark.parametrize("instant", [FAR_FUTURE, "0001-01-01T00:00:00+01:00", "1900-01-01"])
def test_an_instant_outside_2000_to_2100_is_a_400_naming_the_parameter(
    staff: APIClient, url: str, instant: str
) -> None:
    from urllib.parse import quote

    response = staff.get(url.format(quote(instant)))
    name = url.split("?")[1].split("=")[0]
    assert name in json_error(response, 400)


def test_an_instant_with_an_odd_offset_is_normalised_to_utc(staff: APIClient) -> None:
    response = staff.get("/api/v1/margin/?start=2026-01-01T00:00:00%2B05:45&end=2026-01-02")
    assert response.status_code == 200, response.content
    assert response.json()["start"] == "2025-12-31T18:15:00Z"


def test_a_far_future_price_sheet_is_a_400_naming_effective_from(
    staff: APIClient, unchanged: Callable[[], None]
) -> None:
    body = {
        "model": "llama-3.1-8b",
        "input_usd_per_mtok": "1",
        "cached_input_usd_per_mtok": "1",
        "output_usd_per_mtok": "1",
        "effective_from": FAR_FUTURE,
    }
    response = staff.post("/api/v1/price-sheets/", body, format="json")
    assert "effective_from" in json_error(response, 400)
    unchanged()


@pytest.mark.parametrize(
    "change",
    [
        {"replicas_max": 2147483647, "replicas_min": 2147483647},
        {"replicas_min": 2147483647},
        {"replicas_desired": 0, "replicas_min": 5},
    ],
)
def test_replica_bounds_out_of_order_are_a_400_not_an_integrity_error(
    staff: APIClient, world: World, unchanged: Callable[[], None], change: dict[str, int]
) -> None:
    url = f"/api/v1/deployments/{world.ids['deployments']}/"
    errors = json_error(staff.patch(url, change, format="json"), 400)
    assert "replicas_desired" in errors
    unchanged()


def test_a_replica_count_beyond_the_column_is_a_400_naming_it(
    staff: APIClient, world: World, unchanged: Callable[[], None]
) -> None:
    url = f"/api/v1/deployments/{world.ids['deployments']}/"
    errors = json_error(staff.patch(url, {"replicas_max": 2147483648}, format="json"), 400)
    assert "replicas_max" in errors
    unchanged()


@pytest.mark.parametrize("path", ["nope/", "tenants/a%2Fb/quota/", "models/1.5/"])
def test_an_unrouted_api_path_is_a_json_404(staff: APIClient, path: str) -> None:
    json_error(staff.get(f"/api/v1/{path}"), 404)


@pytest.mark.parametrize("debug", [True, False])
@pytest.mark.parametrize("path", ["/api/v1/models", "/api/v1/foo", "/api/v1"])
def test_a_post_to_an_api_path_without_its_slash_is_a_json_404_not_a_redirect(
    staff: APIClient, unchanged: Callable[[], None], settings: Any, debug: bool, path: str
) -> None:
    """Django's APPEND_SLASH raised under DEBUG (a 500) and redirected otherwise (the body
    lost); every route ends with a slash, and the 404 says so, a GET's too."""
    settings.DEBUG = debug
    error = json_error(staff.post(path, {"name": "m"}, format="json"), 404)
    assert "end with '/'" in error["detail"]
    unchanged()
    assert "end with '/'" in json_error(staff.get("/api/v1/models"), 404)["detail"]


def test_the_schema_and_docs_are_still_served(staff: APIClient) -> None:
    assert staff.get("/api/v1/schema/").status_code == 200
    assert staff.get("/api/v1/docs/").status_code == 200


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"name": "m", "tags": [1e400]}', "out of range"),
        (b'{"name": "m", "tags": [NaN]}', "not valid JSON"),
    ],
)
@pytest.mark.parametrize("url", ["/api/v1/models/", "/api/v1/rollouts/", "/api/v1/tenants/"])
def test_a_body_too_deep_or_a_number_past_a_double_is_a_400_parse_error(
    staff: APIClient, unchanged: Callable[[], None], url: str, raw: bytes, says: str
) -> None:
    error = json_error(staff.post(url, raw, content_type="application/json"), 400)
    assert says in error["detail"]
    unchanged()


@pytest.mark.parametrize("path", ["/api/v1/tenants/%00/", "/api/v1/tenants/a%00b/quota/"])
def test_a_nul_character_in_a_path_is_a_404(staff: APIClient, path: str) -> None:
    json_error(staff.get(path), 404)


@pytest.mark.parametrize("thresholds", [5, [1, 2], True, {"max_error_rate_increase": "x"}])
def test_gate_thresholds_that_are_no_object_of_numbers_are_a_400_naming_them(
    staff: APIClient, world: World, unchanged: Callable[[], None], thresholds: Any
) -> None:
    body = {
        "baseline": world.ids["deployments"],
        "target_version": ModelVersion.objects.get().pk,
        "gate_thresholds": thresholds,
    }
    assert "gate_thresholds" in json_error(
        staff.post("/api/v1/rollouts/", body, format="json"), 400
    )
    unchanged()


@pytest.mark.parametrize("field", ["layers", "hidden", "kv_heads", "head_dim", "max_context"])
def test_a_model_of_no_layers_or_kv_heads_is_a_400_naming_the_field(
    staff: APIClient, unchanged: Callable[[], None], field: str
) -> None:
    """Such a model holds no KV: once deployed, every loop that sizes KV capacity (reconcile,
    the routing table, the autoscaler) divided by zero on it, for every deployment."""
    body = {
        "name": "hollow",
        "family": "llama",
        "params_b": 8,
        "layers": 32,
        "hidden": 4096,
        "kv_heads": 8,
        "head_dim": 128,
        "max_context": 8192,
        field: 0,
    }
    assert field in json_error(staff.post("/api/v1/models/", body, format="json"), 400)
    unchanged()


@pytest.mark.parametrize("slug", ["2", "0", "1180591620717411303424"])
def test_a_tenant_slug_of_digits_alone_is_a_400_naming_slug(
    staff: APIClient, unchanged: Callable[[], None], slug: str
) -> None:
    """A slug "2" read as tenant 2's id: its pages and its DELETE reached another tenant."""
    body = {"slug": slug, "name": "Digits"}
    assert "slug" in json_error(staff.post("/api/v1/tenants/", body, format="json"), 400)
    unchanged()


def test_an_id_written_in_other_digits_finds_no_tenant(staff: APIClient, world: World) -> None:
    assert staff.get(f"/api/v1/tenants/{world.acme.pk}/").status_code == 200
    fullwidth = "".join(chr(ord("０") + int(d)) for d in str(world.acme.pk))
    json_error(staff.get(f"/api/v1/tenants/{fullwidth}/"), 404)


def test_a_model_too_large_for_a_double_is_a_400_naming_params_b(
    staff: APIClient, world: World, unchanged: Callable[[], None]
) -> None:
    url = f"/api/v1/models/{world.ids['models']}/"
    response = staff.patch(url, {"params_b": 1.7e308}, format="json")
    assert "params_b" in json_error(response, 400)
    unchanged()
    assert staff.get("/api/v1/versions/").status_code == 200


def test_a_body_past_the_upload_limit_is_a_413_in_drfs_format(
    staff: APIClient, unchanged: Callable[[], None]
) -> None:
    raw = b'{"name": "' + b"x" * 3_000_000 + b'"}'
    error = json_error(staff.post("/api/v1/models/", raw, content_type="application/json"), 413)
    assert "larger than" in error["detail"]
    unchanged()


def test_a_write_to_no_route_with_a_session_and_no_csrf_token_is_a_json_404(
    world: World, unchanged: Callable[[], None]
) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(world.staff)
    for path in ("/api/v1/versions/1.5/approve/", "/api/v1/nope", "/api/v2/"):
        json_error(client.post(path, {}, format="json"), 404)
    unchanged()


@pytest.mark.parametrize(
    ("url", "raw", "field"),
    [
        ("pools/{pools}/", b'{"labels": {"zone": "a\\u0000"}}', "labels"),
        ("tenants/acme/", b'{"allowed_regions": ["\\u0000"]}', "allowed_regions"),
        ("deployments/{deployments}/", b'{"engine_args": {"\\u0000": 1}}', "engine_args"),
    ],
)
def test_a_json_escaped_nul_inside_a_json_field_is_a_400_naming_it(
    staff: APIClient, world: World, unchanged: Callable[[], None], url: str, raw: bytes, field: str
) -> None:
    """Parsed, the escape is a NUL, which jsonb refuses: DRF's 400, not a DataError."""
    path = "/api/v1/" + url.format(**world.ids)
    response = staff.patch(path, raw, content_type="application/json")
    assert field in json_error(response, 400)
    unchanged()


def other_digits(pk: int) -> str:
    """`pk` in fullwidth digits, which int() reads as the same number."""
    return "".join(chr(ord("０") + int(digit)) for digit in str(pk))


ROW_PATHS = ["pools/{}/", "models/{}/", "deployments/{}/", "tenants/acme/keys/{}/"]


@pytest.mark.parametrize("path", ROW_PATHS)
@pytest.mark.parametrize("written", ["%20{}", "{}%20", "+{}", "fullwidth"])
def test_an_id_in_a_path_that_is_not_ascii_digits_finds_no_row(
    staff: APIClient, world: World, unchanged: Callable[[], None], path: str, written: str
) -> None:
    """int() read " 2", "2 ", "+2" and "２" as row 2: each found it, and could change it."""
    pk = world.ids[path.split("/")[-3]]
    given = other_digits(pk) if written == "fullwidth" else written.format(pk)
    url = "/api/v1/" + path.format(given)
    assert staff.get("/api/v1/" + path.format(pk)).status_code == 200
    json_error(staff.get(url), 404)
    json_error(staff.patch(url, {"name": "renamed"}, format="json"), 404)
    json_error(staff.delete(url), 404)
    unchanged()


def test_an_action_on_an_id_that_is_not_ascii_digits_finds_no_row(
    staff: APIClient, world: World, unchanged: Callable[[], None]
) -> None:
    url = f"/api/v1/join-tokens/{other_digits(world.ids['join-tokens'])}/revoke/"
    json_error(staff.post(url, {}, format="json"), 404)
    unchanged()


@pytest.mark.parametrize("written", [" {}", "{} ", "+{}", "fullwidth", "float"])
def test_an_id_in_a_body_that_is_not_an_id_is_a_400_naming_the_field(
    staff: APIClient, world: World, unchanged: Callable[[], None], written: str
) -> None:
    pk = world.ids["deployments"]
    given: Any = {"fullwidth": other_digits(pk), "float": float(pk)}.get(written)
    body = {
        "baseline": written.format(pk) if given is None else given,
        "target_version": ModelVersion.objects.get().pk,
    }
    assert "baseline" in json_error(staff.post("/api/v1/rollouts/", body, format="json"), 400)
    unchanged()


@pytest.mark.parametrize("labels", ["zone-a", ["zone", "a"], 5, {"zone": 1}, {"zone": None}])
@pytest.mark.parametrize("method", ["patch", "post"])
def test_pool_labels_that_are_no_object_of_text_are_a_400_naming_labels(
    staff: APIClient, world: World, unchanged: Callable[[], None], labels: Any, method: str
) -> None:
    if method == "patch":
        url, body = f"/api/v1/pools/{world.ids['pools']}/", {"labels": labels}
    else:
        url = "/api/v1/pools/"
        body = {"name": "l4", "gpu_class": "H100-SXM-80GB", "region": "x", "labels": labels}
    response = getattr(staff, method)(url, body, format="json")
    assert "labels" in json_error(response, 400)
    unchanged()


def test_a_pool_with_labels_an_older_release_stored_as_numbers_still_takes_a_new_price(
    staff: APIClient, world: World
) -> None:
    GpuPool.objects.filter(pk=world.ids["pools"]).update(labels={"gpus": 8, "spot": True})
    url = f"/api/v1/pools/{world.ids['pools']}/"
    response = staff.patch(url, {"usd_per_gpu_hour": "2.50"}, format="json")
    assert response.status_code == 200, response.content
    assert GpuPool.objects.get(pk=world.ids["pools"]).usd_per_gpu_hour == Decimal("2.50")
    assert "labels" in json_error(staff.patch(url, {"labels": {"gpus": 8}}, format="json"), 400)


def test_pool_labels_of_text_are_kept(staff: APIClient, world: World) -> None:
    url = f"/api/v1/pools/{world.ids['pools']}/"
    response = staff.patch(url, {"labels": {"zone": "a", "team": "ml"}}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["labels"] == {"zone": "a", "team": "ml"}


@pytest.mark.parametrize(
    ("names", "field"),
    [
        ({"model": "<script>"}, "model"),
        ({"model": "Llama-3.1-8B"}, "model"),
        ({"model": "llama 3.1 8b"}, "model"),
        ({"model": "llama-3.1-8b", "adapter": "<b>support</b>"}, "adapter"),
    ],
)
def test_a_price_sheet_for_a_name_the_registry_would_not_give_is_a_400_naming_it(
    staff: APIClient, unchanged: Callable[[], None], names: dict[str, str], field: str
) -> None:
    """A price is for a served model name (the rule of Model.name and Adapter.name); a model
    not registered yet may be priced, a name no model could have may not."""
    body = {
        "input_usd_per_mtok": "1",
        "cached_input_usd_per_mtok": "1",
        "output_usd_per_mtok": "1",
        "effective_from": "2026-06-01T00:00:00Z",
        **names,
    }
    response = staff.post("/api/v1/price-sheets/", body, format="json")
    assert field in json_error(response, 400)
    unchanged()


@pytest.mark.parametrize("adapter", ["acme-support_v2", "sql-lora.v2"])
def test_a_price_sheet_for_a_model_not_registered_yet_is_accepted(
    staff: APIClient, adapter: str
) -> None:
    """An adapter's name may hold a dot, as the registry's rule lets it (a slug may not)."""
    body = {
        "model": "qwen2.5-72b",
        "adapter": adapter,
        "input_usd_per_mtok": "1",
        "cached_input_usd_per_mtok": "1",
        "output_usd_per_mtok": "1",
        "effective_from": "2026-06-01T00:00:00Z",
    }
    response = staff.post("/api/v1/price-sheets/", body, format="json")
    assert response.status_code == 201, response.content


@pytest.mark.parametrize(
    ("url", "field", "given", "stored"),
    [
        ("tenants/acme/", "blocked_patterns", ["a+", "b", "a+"], ["a+", "b"]),
        ("tenants/acme/", "allowed_regions", ["us", "eu", "us"], ["us", "eu"]),
        ("tenants/acme/quota/", "allowed_tiers", ["batch", "batch"], ["batch"]),
        ("tenants/acme/keys/{keys}/", "model_allowlist", ["m", "a", "m"], ["a", "m"]),
        ("tenants/acme/keys/{keys}/", "scopes", ["inference", "inference"], ["inference"]),
    ],
)
def test_a_list_given_with_an_entry_twice_is_stored_with_it_once(
    staff: APIClient, world: World, url: str, field: str, given: list[str], stored: list[str]
) -> None:
    """Each is a set in meaning (the gateway asks whether a name is in it): a repeat is kept
    once, not refused, and the answer shows the list as stored."""
    response = staff.patch("/api/v1/" + url.format(**world.ids), {field: given}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()[field] == stored
    assert staff.get("/api/v1/" + url.format(**world.ids)).json()[field] == stored


@pytest.mark.parametrize(
    ("method", "url", "body", "field"),
    [
        (
            "post",
            "join-tokens/",
            {"pool": "h100-us-east", "name": "t", "ttl_hours": True},
            "ttl_hours",
        ),
        ("patch", "tenants/acme/quota/", {"soft_alert_fraction": True}, "soft_alert_fraction"),
        ("patch", "models/{models}/", {"params_b": True}, "params_b"),
        ("patch", "tenants/acme/quota/", {"requests_per_minute": True}, "requests_per_minute"),
        (
            "patch",
            "tenants/acme/quota/",
            {"monthly_spend_budget_usd": False},
            "monthly_spend_budget_usd",
        ),
    ],
)
def test_true_or_false_given_for_a_number_is_a_400_naming_the_field(
    staff: APIClient,
    world: World,
    unchanged: Callable[[], None],
    method: str,
    url: str,
    body: dict[str, Any],
    field: str,
) -> None:
    """float(True) is 1.0: a token of one hour, a model of 1 billion parameters."""
    path = "/api/v1/" + url.format(**world.ids)
    assert field in json_error(getattr(staff, method)(path, body, format="json"), 400)
    unchanged()


def test_a_gate_threshold_of_true_is_a_400_naming_gate_thresholds(
    staff: APIClient, world: World, unchanged: Callable[[], None]
) -> None:
    body = {
        "baseline": world.ids["deployments"],
        "target_version": world.ids["versions"],
        "gate_thresholds": {"max_error_rate_increase": True},
    }
    response = staff.post("/api/v1/rollouts/", body, format="json")
    assert "gate_thresholds" in json_error(response, 400)
    unchanged()


@pytest.mark.parametrize("parameter", ["deployment", "node"])
@pytest.mark.parametrize("given", ["abc", "%20{}", "fullwidth"])
def test_a_replica_filter_by_an_id_that_is_not_ascii_digits_is_a_400_naming_it(
    staff: APIClient, world: World, parameter: str, given: str
) -> None:
    """A filter of "abc" was a ValueError in the query, a 500; " 2" and "２" took row 2."""
    pk = world.ids[f"{parameter}s"]
    value = other_digits(pk) if given == "fullwidth" else given.format(pk)
    assert staff.get(f"/api/v1/replicas/?{parameter}={pk}").json()["count"] == 1
    response = staff.get(f"/api/v1/replicas/?{parameter}={value}")
    assert parameter in json_error(response, 400)


@pytest.mark.parametrize("route", ["usage/", "usage/events/"])
@pytest.mark.parametrize("given", ["%20{}", "%2B{}", "{}.0", "fullwidth"])
def test_a_usage_query_by_a_key_id_that_is_not_ascii_digits_is_a_400_naming_key(
    staff: APIClient, world: World, route: str, given: str
) -> None:
    """DRF's IntegerField read " 2", "+2", "2.0" and "２" as key 2."""
    pk = world.ids["keys"]
    value = other_digits(pk) if given == "fullwidth" else given.format(pk)
    assert staff.get(f"/api/v1/tenants/acme/{route}?key={pk}").status_code == 200
    response = staff.get(f"/api/v1/tenants/acme/{route}?key={value}")
    assert "key" in json_error(response, 400)
