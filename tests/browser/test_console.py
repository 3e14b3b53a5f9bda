"""The admin console in a real browser: the live overview (its chart drawn from the recent
history on load), and a rollout's pause and resume."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import redis
from django.utils import timezone
from playwright.sync_api import Page, expect

from registry.actions import do_start_rollout
from registry.models import Deployment, Rollout
from serving import telemetry
from serving.actions import nodes as fleet_nodes
from serving.console.live import publish_fleet_snapshot
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from tenants.actions import do_create_tenant
from tests.browser.conftest import in_thread, log_in, make_user, screenshot
from tests.gateway.conftest import GatewayServer
from tests.metering.helpers import stored
from tests.registry.conftest import approved_version, make_model

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def deployment_on(pool: GpuPool, replicas: int = 2) -> Deployment:
    model = make_model("llama-3.1-8b")
    version = approved_version(model, "v1", "bf16")
    return Deployment.objects.create(
        name="llama-8b-h100",
        model_version=version,
        pool=pool,
        replicas_min=1,
        replicas_max=4,
        replicas_desired=replicas,
        engine_args={"max_model_len": 4096},
    )


def h100_pool() -> GpuPool:
    return GpuPool.objects.create(
        name="h100-us-east",
        gpu_class=GpuClass.objects.get(name="H100-SXM-80GB"),
        region="us-east",
    )


@pytest.fixture
def serving_fleet(gpu_classes: None, redis_client: redis.Redis) -> dict[str, Any]:
    """One node with two GPUs, each running a ready replica with fresh telemetry."""
    pool = h100_pool()
    node = Node.objects.create(
        pool=pool,
        hostname="gpu-node-1",
        agent_url="http://gpu-node-1:9100",
        last_heartbeat_at=timezone.now(),
    )
    for index in range(2):
        Gpu.objects.create(
            node=node, index=index, uuid=f"GPU-{index}", name="H100", memory_mb=81559
        )
    deployment = deployment_on(pool)
    replicas = [
        Replica.objects.create(
            deployment=deployment,
            node=node,
            gpu_indices=[index],
            port=18000 + index,
            state=Replica.State.READY,
        )
        for index in range(2)
    ]
    scraped = [
        (
            r.replica_id,
            {
                "num_requests_running": 3,
                "num_requests_waiting": 1,
                "kv_cache_usage_perc": 0.25,
                "generation_tokens_total": 1000,
            },
        )
        for r in replicas
    ]
    gpus = [{"index": i, "utilization_pct": 80.0} for i in range(2)]
    telemetry.store_latest(redis_client, node.pk, gpus, scraped, timezone.now())
    return {"node": node, "replicas": replicas}


def test_an_admin_sees_the_live_fleet_change_when_a_replica_stops(
    gateway_server: GatewayServer, serving_fleet: dict[str, Any], page: Page
) -> None:
    make_user("ops", is_staff=True)
    # Three interactive answers of the last minute: two within both clocks, one whose first
    # token came in time and whose decode did not (80 ms a token against 50).
    acme = do_create_tenant("acme", "Acme")
    for tpot_ms in (40.0, 45.0, 80.0):
        at = timezone.now() - timedelta(seconds=60)
        stored(acme, at, priority="interactive", ttft_ms=300.0, completion_tokens=11,
               total_ms=300.0 + 10 * tpot_ms)  # fmt: skip
    log_in(page, gateway_server.url, "ops")
    expect(page).to_have_url(f"{gateway_server.url}/console/")
    expect(page.locator("#live-status")).to_have_text("live")
    ready = page.locator('[data-live="replicas_ready"]')
    expect(ready).to_have_text("2")
    expect(page.locator('[data-live="slo_interactive"]')).to_have_text("66.67%")
    expect(page.locator('[data-live="tpot_p50_ms"]')).to_have_text("45 ms")
    expect(page.locator("#replica-table tbody tr")).to_have_count(2)

    node, (kept, stopped) = serving_fleet["node"], serving_fleet["replicas"]
    fleet_nodes.do_record_heartbeat(
        node,
        {
            "gpus": [{"index": 0, "utilization_pct": 80.0}],
            "events": [],
            "replicas": [
                {"replica_id": kept.replica_id, "state": "Ready"},
                {"replica_id": stopped.replica_id, "state": "Stopped"},
            ],
        },
    )
    assert Replica.objects.get(pk=stopped.pk).state == Replica.State.STOPPED
    in_thread(publish_fleet_snapshot)

    # No reload: the WebSocket brought the change.
    expect(ready).to_have_text("1")
    expect(page.locator("#replica-table tbody tr")).to_have_count(1)
    expect(page.locator(f'#replica-table tr[data-replica="{stopped.pk}"]')).to_have_count(0)
    expect(page.locator("#gpu-table tbody tr").first).to_contain_text("H100-SXM-80GB")
    screenshot(page, "console-overview-after-replica-stopped")


def test_the_overview_chart_shows_the_recent_history_as_soon_as_the_page_loads(
    gateway_server: GatewayServer,
    serving_fleet: dict[str, Any],
    redis_client: redis.Redis,
    page: Page,
) -> None:
    node, replicas = serving_fleet["node"], serving_fleet["replicas"]
    for generated in (2000, 4000, 6000):
        scraped = [
            (r.replica_id, {"num_requests_waiting": 1, "generation_tokens_total": generated})
            for r in replicas
        ]
        telemetry.store_latest(redis_client, node.pk, [], scraped, timezone.now())
        in_thread(publish_fleet_snapshot)
    make_user("ops", is_staff=True)

    log_in(page, gateway_server.url, "ops")
    expect(page).to_have_url(f"{gateway_server.url}/console/")
    page.wait_for_function("document.getElementById('fleet-chart').uplot !== undefined")
    # No broadcast follows the page load, and the snapshots of the page and of the socket's
    # handshake carry no token rate: rates on the chart can only come from the history.
    data = page.evaluate("document.getElementById('fleet-chart').uplot.data")
    at, tokens, queue = data
    assert len(at) >= 3
    assert len([rate for rate in tokens if rate is not None]) == 2
    assert all(rate > 0 for rate in tokens if rate is not None)
    assert queue[:3] == [2, 2, 2]
    assert at == sorted(at)
    screenshot(page, "console-overview-chart-on-load")


@pytest.fixture
def running_rollout(gpu_classes: None, redis_client: redis.Redis) -> Rollout:
    baseline = deployment_on(h100_pool(), replicas=1)
    target = approved_version(baseline.model_version.model, "v2", "bf16")
    staff = make_user("rollout-bot", is_staff=True)
    return do_start_rollout(baseline, target, actor=staff, step_min_duration_s=600)


def test_an_admin_pauses_and_resumes_a_rollout(
    gateway_server: GatewayServer, running_rollout: Rollout, page: Page
) -> None:
    make_user("ops", is_staff=True)
    log_in(page, gateway_server.url, "ops")
    page.click("nav >> text=Rollouts")
    page.click(f"text=#{running_rollout.pk}")
    state = page.locator("#rollout-state")
    expect(state).to_have_text("running")
    weight = page.locator("#rollout-weight").inner_text()

    page.click("button:has-text('Pause')")
    expect(state).to_have_text("paused")
    expect(page.locator("#transitions")).to_contain_text("paused by staff")
    assert Rollout.objects.get(pk=running_rollout.pk).state == Rollout.State.PAUSED

    paused_at = timezone.now()
    page.click("button:has-text('Resume')")
    expect(state).to_have_text("running")
    expect(page.locator("#transitions")).to_contain_text("resumed by staff")
    rollout = Rollout.objects.get(pk=running_rollout.pk)
    assert rollout.state == Rollout.State.RUNNING
    # The pause does not count towards the step: its window starts again on resume.
    assert rollout.step_started_at >= paused_at - timedelta(seconds=1)
    assert page.locator("#rollout-weight").inner_text() == weight
    assert [t.to_state for t in rollout.transitions.order_by("created_at")][-2:] == [
        "paused",
        "running",
    ]
    screenshot(page, "console-rollout-paused-and-resumed")
