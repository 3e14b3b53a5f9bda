"""Console and portal pages through Django's test client: roles, tenant isolation, CSRF,
the placement check before saving, and the fleet snapshot's figures."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from django.test import Client
from django.utils import timezone

from registry.models import Deployment
from serving import telemetry
from serving.actions.gpu_classes import sync_gpu_classes
from serving.console.live import publish_fleet_snapshot
from serving.console.queries import (
    HISTORY_POINTS,
    fleet_history,
    fleet_snapshot,
    record_fleet_history,
)
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from tenants.actions import do_create_api_key, do_create_tenant
from tenants.models import ApiKey, Membership, Role, Tenant
from tests.admin_pages import admin_form
from tests.registry.conftest import approved_version, make_model

PASSWORD = "pw-for-tests-only"


def user(username: str, **fields: Any) -> Any:
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(username, password=PASSWORD, **fields)


def client_for(account: Any, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(account)
    return client


def member(tenant: Tenant, username: str, role: str) -> Any:
    account = user(username)
    Membership.objects.create(user=account, tenant=tenant, role=role)
    return account


@pytest.fixture
def acme(db: None) -> Tenant:
    return do_create_tenant("acme", "Acme")


@pytest.fixture
def globex(db: None) -> Tenant:
    return do_create_tenant("globex", "Globex")


@pytest.fixture
def pool(db: None) -> GpuPool:
    sync_gpu_classes(GpuClass)
    return GpuPool.objects.create(
        name="h100-us-east", gpu_class=GpuClass.objects.get(name="H100-SXM-80GB"), region="us-east"
    )


CONSOLE_PAGES = [
    "/console/",
    "/console/fleet/",
    "/console/models/",
    "/console/rollouts/",
    "/console/tenants/",
    "/console/billing/",
    "/console/router/",
]


@pytest.mark.parametrize("path", CONSOLE_PAGES)
def test_a_console_page_is_refused_to_a_tenant_member(acme: Tenant, path: str) -> None:
    reply = client_for(member(acme, "dev", Role.DEVELOPER)).get(path)
    assert reply.status_code == 403


@pytest.mark.parametrize("path", CONSOLE_PAGES)
def test_a_console_page_renders_for_staff(
    acme: Tenant, redis_client: redis.Redis, path: str
) -> None:
    reply = client_for(user("ops", is_staff=True)).get(path)
    assert reply.status_code == 200
    assert b"<h1>" in reply.content


def test_an_anonymous_visitor_is_sent_to_the_login_page(db: None) -> None:
    reply = Client().get("/console/")
    assert reply.status_code == 302 and reply["Location"].startswith("/login/")


@pytest.mark.parametrize("page", ["", "models/", "usage/", "invoices/", "playground/"])
def test_a_member_of_another_tenant_gets_a_404(acme: Tenant, globex: Tenant, page: str) -> None:
    outsider = client_for(member(globex, "spy", Role.OWNER))
    assert outsider.get(f"/portal/acme/{page}").status_code == 404


def test_revoking_another_tenants_key_is_a_404_and_leaves_it_alive(
    acme: Tenant, globex: Tenant
) -> None:
    key, _ = do_create_api_key(acme, "acme key", None, ["inference"])
    outsider = client_for(member(globex, "spy", Role.OWNER))
    assert outsider.post(f"/portal/globex/keys/{key.pk}/revoke/").status_code == 404
    assert outsider.post(f"/portal/acme/keys/{key.pk}/revoke/").status_code == 404
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None


def test_a_developer_sees_the_secret_once_and_only_its_hash_is_kept(acme: Tenant) -> None:
    dev = client_for(member(acme, "dev", Role.DEVELOPER))
    created = dev.post("/portal/acme/keys/create/", {"name": "ci", "scopes": ["inference"]})
    assert created.status_code == 302  # POST-redirect-GET: a reload creates nothing
    key = ApiKey.objects.get(tenant=acme, name="ci")
    reply = dev.get(created["Location"])
    secret = reply.context["new_key"]["secret"]
    assert secret.encode() in reply.content and reply["Cache-Control"] == "no-store"
    assert secret not in key.secret_hash
    assert secret.encode() not in dev.get(created["Location"]).content  # once only
    assert secret.encode() not in dev.get("/portal/acme/").content


def test_a_viewer_cannot_revoke_a_key(acme: Tenant) -> None:
    key, _ = do_create_api_key(acme, "prod", None, ["inference"])
    viewer = client_for(member(acme, "watcher", Role.VIEWER))
    assert viewer.post(f"/portal/acme/keys/{key.pk}/revoke/").status_code == 403
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None


def test_a_developer_revokes_only_the_keys_they_created_and_an_admin_any(acme: Tenant) -> None:
    owner = member(acme, "boss", Role.ADMIN)
    dev_account = member(acme, "dev", Role.DEVELOPER)
    production, _ = do_create_api_key(acme, "prod", owner, ["inference"])
    own, _ = do_create_api_key(acme, "mine", dev_account, ["inference"])
    dev = client_for(dev_account)

    refused = dev.post(f"/portal/acme/keys/{production.pk}/revoke/", follow=True)
    assert "prod not revoked" in refused.content.decode()
    assert "This needs the admin role in acme." in refused.content.decode()
    assert ApiKey.objects.get(pk=production.pk).revoked_at is None

    assert dev.post(f"/portal/acme/keys/{own.pk}/revoke/").status_code == 302
    assert ApiKey.objects.get(pk=own.pk).revoked_at is not None
    assert client_for(owner).post(f"/portal/acme/keys/{production.pk}/revoke/").status_code == 302
    assert ApiKey.objects.get(pk=production.pk).revoked_at is not None


def test_a_viewer_cannot_mint_a_playground_key(acme: Tenant) -> None:
    viewer = client_for(member(acme, "watcher", Role.VIEWER))
    assert viewer.post("/portal/acme/playground/key/").status_code == 403
    assert not ApiKey.objects.filter(tenant=acme).exists()


def test_the_playground_key_is_inference_only_and_expires_within_the_hour(acme: Tenant) -> None:
    dev = client_for(member(acme, "dev", Role.DEVELOPER))
    reply = dev.post("/portal/acme/playground/key/")
    key = ApiKey.objects.get(tenant=acme)
    assert reply.json()["key"].startswith("sk-") and key.name == "playground (dev)"
    assert key.scopes == ["inference"] and key.expires_at is not None
    lifetime = (key.expires_at - timezone.now()).total_seconds()
    assert 3500 < lifetime <= 3600


def test_using_the_playground_again_hands_back_the_same_key(acme: Tenant) -> None:
    dev = client_for(member(acme, "dev", Role.DEVELOPER))
    first = dev.post("/portal/acme/playground/key/").json()["key"]
    again = dev.post("/portal/acme/playground/key/").json()["key"]
    assert again == first and ApiKey.objects.filter(tenant=acme).count() == 1
    # Another browser of the same member holds no secret: a new key, the old one revoked.
    other = client_for(Membership.objects.get(tenant=acme).user)
    fresh = other.post("/portal/acme/playground/key/").json()["key"]
    assert fresh != first
    assert ApiKey.objects.filter(tenant=acme, revoked_at__isnull=True).count() == 1


def test_a_post_without_a_csrf_token_is_refused(acme: Tenant) -> None:
    dev = client_for(member(acme, "dev", Role.DEVELOPER), csrf=True)
    reply = dev.post("/portal/acme/keys/create/", {"name": "forged", "scopes": ["inference"]})
    assert reply.status_code == 403
    assert not ApiKey.objects.filter(tenant=acme).exists()


def deployment_form(version_pk: int, pool_pk: int) -> dict[str, Any]:
    """The console's deployment form as staff fill it: one replica, TP 1, standard tier."""
    return {
        "model_version": version_pk,
        "pool": pool_pk,
        "tensor_parallel": 1,
        "max_model_len": 8192,
        "replicas_min": 1,
        "replicas_desired": 1,
        "replicas_max": 1,
        "slo_tier": "standard",
    }


def test_the_placement_check_names_the_problem_before_anything_is_saved(pool: GpuPool) -> None:
    version = approved_version(make_model("llama-3.1-70b"), "v1", "bf16")
    staff = client_for(user("ops", is_staff=True))
    form = deployment_form(version.pk, pool.pk)
    reply = staff.post("/console/deployments/check/", form)
    assert b"Does not fit" in reply.content
    assert not Deployment.objects.exists()
    fits = staff.post("/console/deployments/check/", {**form, "tensor_parallel": 4})
    # It fits the class's memory at TP 4; the pool has no node yet, so it would wait for one.
    assert b"Fits in GPU memory" in fits.content
    assert b"Pending capacity" in fits.content and b"no ready, schedulable node" in fits.content


def test_staff_create_a_disaggregated_deployment_from_the_form(pool: GpuPool) -> None:
    version = approved_version(make_model("llama-3.1-8b"), "v1", "bf16")
    decode_pool = GpuPool.objects.create(
        name="h200-us-east", gpu_class=GpuClass.objects.get(name="H200-SXM-141GB")
    )
    cpu_pool = GpuPool.objects.create(
        name="cpu-local", gpu_class=GpuClass.objects.get(name="CPU-X86-2C")
    )
    staff = client_for(user("ops", is_staff=True))
    form = {
        "model_version": version.pk,
        "pool": pool.pk,
        "tensor_parallel": 1,
        "max_model_len": 8192,
        "replicas_min": 1,
        "replicas_desired": 1,
        "replicas_max": 2,
        "decode_pool": decode_pool.pk,
        "kv_connector": "nixl",
        "decode_replicas_min": 1,
        "decode_replicas_desired": 2,
        "decode_replicas_max": 4,
        "slo_tier": "standard",
    }
    # NIXL on a CPU decode pool: the live check says why before anything is saved.
    refused = staff.post("/console/deployments/check/", {**form, "decode_pool": cpu_pool.pk})
    assert b"NIXL needs GPU nodes" in refused.content
    checked = staff.post("/console/deployments/check/", form).content
    assert b"Fits in GPU memory" in checked and b"Pending capacity" in checked

    reply = staff.post("/console/deployments/create/", form, follow=True)

    (created,) = Deployment.objects.all()
    assert (created.pool, created.decode_pool, created.kv_connector) == (pool, decode_pool, "nixl")
    assert (created.decode_replicas_min, created.decode_replicas_desired) == (1, 2)
    assert created.decode_replicas_max == 4
    page = reply.content.decode()
    assert "h200-us-east (decode, NIXL (GPU nodes))" in page
    # Without a decode pool the connector is not asked for: an ordinary deployment.
    staff.post("/console/deployments/create/", {**form, "decode_pool": "", "name": "whole"})
    assert Deployment.objects.get(name="whole").decode_pool is None


def test_the_fleet_snapshot_counts_gpus_by_state_and_prices_every_ready_gpu(
    pool: GpuPool, redis_client: redis.Redis
) -> None:
    node = Node.objects.create(pool=pool, hostname="n1", agent_url="http://n1:9100")
    for index in range(4):
        Gpu.objects.create(node=node, index=index, uuid=f"G{index}", name="H100", memory_mb=81559)
    version = approved_version(make_model("llama-3.1-8b"), "v1", "bf16")
    deployment = Deployment.objects.create(name="d", model_version=version, pool=pool)
    ready = Replica.objects.create(
        deployment=deployment, node=node, gpu_indices=[0], state=Replica.State.READY
    )
    Replica.objects.create(
        deployment=deployment, node=node, gpu_indices=[1], state=Replica.State.STARTING
    )
    telemetry.store_latest(
        redis_client,
        node.pk,
        [{"index": 0, "utilization_pct": 60.0}],
        [(ready.replica_id, {"num_requests_waiting": 3, "kv_cache_usage_perc": 0.5})],
        timezone.now(),
    )
    snapshot = fleet_snapshot(redis_client)
    counts = snapshot["gpus"]["H100-SXM-80GB"]
    assert (counts["ready"], counts["starting"], counts["idle"]) == (1, 1, 2)
    assert snapshot["queue_depth"] == 3 and snapshot["kv_use"] == 0.5
    assert snapshot["cost_per_hour"] == pytest.approx(4 * float(pool.price_per_gpu_hour))


def test_the_chart_history_keeps_the_latest_points_oldest_first(redis_client: redis.Redis) -> None:
    for second in range(HISTORY_POINTS + 5, 0, -1):  # written newest first, on purpose
        point = {"at": float(second), "tokens_per_s": second * 10.0, "queue_depth": 1}
        record_fleet_history(redis_client, point)
    history = fleet_history(redis_client)
    assert len(history["at"]) == HISTORY_POINTS
    assert history["at"] == sorted(history["at"])
    # The list is capped by arrival: the five written first (the latest seconds) fell out.
    assert history["at"][-1] == float(HISTORY_POINTS)
    assert history["tokens_per_s"][0] == 10.0


def test_the_overview_embeds_the_history_the_broadcaster_recorded(
    pool: GpuPool, redis_client: redis.Redis
) -> None:
    node = Node.objects.create(pool=pool, hostname="n1", agent_url="http://n1:9100")
    version = approved_version(make_model("llama-3.1-8b"), "v1", "bf16")
    deployment = Deployment.objects.create(name="d", model_version=version, pool=pool)
    ready = Replica.objects.create(
        deployment=deployment, node=node, gpu_indices=[0], state=Replica.State.READY
    )
    for generated in (1000, 3000):
        telemetry.store_latest(
            redis_client,
            node.pk,
            [],
            [(ready.replica_id, {"num_requests_waiting": 2, "generation_tokens_total": generated})],
            timezone.now(),
        )
        publish_fleet_snapshot()

    reply = client_for(user("ops", is_staff=True)).get("/console/")
    history = reply.context["history"]
    assert len(history["at"]) == 2 and history["queue_depth"] == [2, 2]
    # The first broadcast has no earlier totals to take a rate from; the second has.
    assert history["tokens_per_s"][0] is None and history["tokens_per_s"][1] > 0
    assert b'<script id="fleet-history" type="application/json">' in reply.content


def test_staff_start_a_rollout_from_the_console(pool: GpuPool) -> None:
    from registry.actions import do_create_deployment
    from registry.models import Rollout

    model = make_model("llama-3.1-8b")
    v1 = approved_version(model, "v1", "bf16")
    v2 = approved_version(model, "v2", "bf16")
    baseline = do_create_deployment(name="llama-8b", model_version=v1, pool=pool)
    staff = client_for(user("ops", is_staff=True))
    page = staff.get("/console/rollouts/").content.decode()
    assert f'<option value="{baseline.pk}">' in page
    reply = staff.post(
        "/console/rollouts/start/", {"baseline": baseline.pk, "target_version": v2.pk}
    )
    rollout = Rollout.objects.get()
    assert reply.status_code == 302 and reply["Location"] == f"/console/rollouts/{rollout.pk}/"
    assert rollout.canary.model_version == v2
    # Held at 0 % until its replica serves; the first step's weight waits for it.
    assert rollout.canary.traffic_weight == 0 and rollout.steps[0] == 5
    assert rollout.canary_state == "placing"


def test_a_tenant_member_cannot_start_a_rollout(acme: Tenant, pool: GpuPool) -> None:
    from registry.models import Rollout

    developer = client_for(member(acme, "dev", Role.ADMIN))
    reply = developer.post("/console/rollouts/start/", {"baseline": 1, "target_version": 2})
    assert reply.status_code == 403
    assert not Rollout.objects.exists()


def test_the_playground_offers_only_what_is_deployed_and_the_adapters_on_it(
    acme: Tenant, redis_client: redis.Redis
) -> None:
    from registry.models import Adapter
    from serving.redis_contracts import ROUTING_TABLE_KEY

    deployed = make_model("llama-3.1-8b")
    make_model("llama-3.1-405b")  # visible, but nothing serves it
    Adapter.objects.create(
        name="acme-tone",
        base_version=approved_version(deployed, "v1", "bf16"),
        rank=8,
        artifact_uri="s3://adapters/acme-tone/",
        owner_tenant=acme,
    )
    redis_client.set(ROUTING_TABLE_KEY, b'{"version": 1, "models": {"llama-3.1-8b": {}}}')
    page = client_for(member(acme, "dev", Role.DEVELOPER)).get("/portal/acme/playground/")
    options = page.content.decode()
    assert ">llama-3.1-8b<" in options and ">acme-tone<" in options
    assert "llama-3.1-405b" not in options


def a_request_of(tenant: Tenant, *, price_usd_micros: int, cost_usd_micros: int) -> None:
    from metering.models import UsageEvent

    now = timezone.now()
    UsageEvent.objects.create(
        request_id="req-small",
        tenant_id=tenant.pk,
        model="llama-3.2-1b",
        priority="standard",
        prompt_tokens=120,
        cached_prompt_tokens=0,
        completion_tokens=30,
        status="ok",
        queue_ms=1.0,
        total_ms=300.0,
        price_charged_usd_micros=price_usd_micros,
        cost_to_serve_usd_micros=cost_usd_micros,
        started_at=now,
        ended_at=now,
    )


def test_the_usage_page_shows_a_fraction_of_a_cent_and_not_zero(acme: Tenant) -> None:
    a_request_of(acme, price_usd_micros=6_100, cost_usd_micros=12)
    page = client_for(member(acme, "dev", Role.DEVELOPER)).get("/portal/acme/usage/")
    text = page.content.decode()
    recent = text[text.index('<table id="recent-requests">') :]
    assert "<td>$0.0061</td>" in recent
    assert '<div class="budget"><span>$0.0061 <span class="muted">(no budget)' in text
    assert "$0.00<" not in text


def test_the_usage_page_shows_a_requests_trace_id_beside_it(acme: Tenant) -> None:
    from metering.models import UsageEvent

    a_request_of(acme, price_usd_micros=6_100, cost_usd_micros=12)
    UsageEvent.objects.filter(request_id="req-small").update(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736"
    )

    page = client_for(member(acme, "dev", Role.DEVELOPER)).get("/portal/acme/usage/")

    recent = page.content.decode()
    recent = recent[recent.index('<table id="recent-requests">') :]
    assert (
        '<code class="trace-id" title="4bf92f3577b34da6a3ce929d0e0e4736">4bf92f3577b3</code>'
        in recent
    )


def test_the_console_shows_a_tenants_tiny_cost_to_serve(acme: Tenant) -> None:
    a_request_of(acme, price_usd_micros=6_100, cost_usd_micros=12)
    staff = client_for(user("ops", is_staff=True))
    assert "<td>$0.000012</td>" in staff.get("/console/tenants/").content.decode()
    tenant_page = staff.get("/console/tenants/acme/").content.decode()
    assert '<div class="value">$0.000012</div>' in tenant_page


@pytest.mark.parametrize(
    "changes",
    [
        {"pool": "probe-pool"},
        {"pool": "1.5"},
        {"model_version": "<script>"},
        {"decode_pool": "abc"},
        {"gpu_memory_utilization": "abc"},
        {"gpu_memory_utilization": "nan"},
        {"gpu_memory_utilization": "1.5"},
    ],
)
def test_a_deployment_form_with_a_choice_or_number_not_its_own_says_so(
    pool: GpuPool, changes: dict[str, str]
) -> None:
    version = approved_version(make_model("llama-3.1-8b"), "v1", "bf16")
    staff = client_for(user("ops", is_staff=True))
    form = {**deployment_form(version.pk, pool.pk), "name": "probe", **changes}
    for path in ("/console/deployments/check/", "/console/deployments/create/"):
        reply = staff.post(path, form, follow=True)  # create answers with a message
        assert reply.status_code == 200, (path, reply.status_code)
        page = reply.content.decode()
        assert "Choose a" in page or "GPU memory utilization must be" in page, page[:500]
    assert not Deployment.objects.exists()


def test_a_nul_character_in_a_page_form_or_query_is_a_400_with_a_message(db: None) -> None:
    acme = do_create_tenant("acme", "Acme")
    staff = client_for(user("ops", is_staff=True))
    for reply in (
        staff.post(f"/console/tenants/{acme.slug}/settings/", {"name": "a\x00b"}),
        staff.get("/console/usage/", {"status": "ok\x00"}),
    ):
        assert reply.status_code == 400
        assert b"cannot contain NUL" in reply.content
    assert Tenant.objects.get(pk=acme.pk).name == "Acme"


@pytest.mark.parametrize(
    ("path", "field", "given"),
    [
        ("tenants/tenant", "allowed_regions", '["us-east", "a\\u0000b"]'),
        ("tenants/tenant", "blocked_patterns", '["\\u0000"]'),
    ],
)
def test_a_json_escaped_nul_in_an_admin_json_field_is_refused_on_the_form(
    acme: Tenant, path: str, field: str, given: str
) -> None:
    """The admin's JSON fields parse their text: the escape becomes a NUL, which jsonb refuses
    ("unsupported Unicode escape sequence", a 500). A raw NUL is the middleware's 400. (The
    tenant is the one row with JSON fields the admin writes: config/admin.py.)"""
    row = acme
    before = type(row).objects.values().get(pk=row.pk)
    staff = client_for(user("root", is_staff=True, is_superuser=True))
    url = f"/admin/{path}/{row.pk}/change/"
    form = admin_form(staff, url)

    reply = staff.post(url, {**form, field: given})

    assert reply.status_code == 200
    assert field in reply.context["adminform"].form.errors
    assert "Text cannot contain NUL (\\u0000) characters." in reply.content.decode()
    assert type(row).objects.values().get(pk=row.pk) == before
    assert staff.post(url, form).status_code == 302  # the form as it was still saves


def fullwidth(pk: int) -> str:
    return "".join(chr(ord("０") + int(digit)) for digit in str(pk))


@pytest.mark.parametrize("written", [" {}", "{} ", "+{}", "fullwidth"])
def test_a_rollout_form_whose_baseline_is_not_ascii_digits_starts_nothing_and_says_so(
    pool: GpuPool, written: str
) -> None:
    """int() read " 2" and "２" as deployment 2, and the form started a rollout from it."""
    from registry.actions import do_create_deployment
    from registry.models import Rollout

    model = make_model("llama-3.1-8b")
    v2 = approved_version(model, "v2", "bf16")
    baseline = do_create_deployment(
        name="llama-8b", model_version=approved_version(model, "v1", "bf16"), pool=pool
    )
    given = fullwidth(baseline.pk) if written == "fullwidth" else written.format(baseline.pk)
    staff = client_for(user("ops", is_staff=True))

    reply = staff.post(
        "/console/rollouts/start/", {"baseline": given, "target_version": v2.pk}, follow=True
    )

    assert reply.status_code == 200
    assert "Not started: choose a baseline and a target version." in reply.content.decode()
    assert not Rollout.objects.exists()


def test_the_usage_search_takes_a_key_id_only_in_ascii_digits(acme: Tenant) -> None:
    key, _ = do_create_api_key(acme, "ci", None, ["inference"])
    staff = client_for(user("ops", is_staff=True))

    assert "error" not in staff.get("/console/usage/", {"key": str(key.pk)}).context
    reply = staff.get("/console/usage/", {"key": fullwidth(key.pk)})

    assert reply.context["error"] == "API key: No such API key."


def test_blocked_patterns_typed_twice_on_the_settings_page_are_stored_once(acme: Tenant) -> None:
    staff = client_for(user("ops", is_staff=True))
    form = {"name": "Acme", "blocked_patterns": "secret\nssn \\d+\nsecret\n"}
    reply = staff.post(f"/console/tenants/{acme.slug}/settings/", form, follow=True)
    assert "Settings of acme saved." in reply.content.decode()
    assert Tenant.objects.get(pk=acme.pk).blocked_patterns == ["secret", "ssn \\d+"]
