"""A blocked node drain in a real browser, on a desktop and on a phone: past its deadline the
fleet page says since when and why the drain is blocked, what would unblock it, and offers to
force or cancel it; forcing stops the replica and the node ends drained. The page fits a
390 px screen."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.utils import timezone
from playwright.sync_api import Page, expect

from registry.actions import do_create_deployment
from registry.models import Deployment
from serving.actions.nodes import do_drain_node
from serving.actions.reconcile import do_reconcile
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from tests.browser.conftest import assert_fits, in_thread, log_in, make_user, screenshot
from tests.gateway.conftest import GatewayServer
from tests.registry.conftest import approved_version, make_model

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def blocked_drain(gpu_classes: None, redis_client: redis.Redis) -> Replica:
    """The only node of pool a100-us-east drains while its one replica is the minimum."""
    pool = GpuPool.objects.create(
        name="a100-us-east", gpu_class=GpuClass.objects.get(name="A100-SXM-80GB"), region="us-east"
    )
    node = Node.objects.create(
        pool=pool,
        hostname="a100-1",
        agent_url="http://a100-1:9100",
        last_heartbeat_at=timezone.now(),
    )
    Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="A100", memory_mb=81920)
    deployment = do_create_deployment(
        name="qwen2-5-7b-a100-us-east",
        model_version=approved_version(make_model("qwen2.5-7b"), "v1", "bf16"),
        pool=pool,
    )
    Deployment.objects.filter(pk=deployment.pk).update(replicas_min=1, replicas_desired=1)
    in_thread(do_reconcile)
    Replica.objects.filter(deployment=deployment).update(state=Replica.State.READY, port=18001)
    make_user("ops", is_staff=True)
    in_thread(lambda: do_drain_node(node))
    in_thread(do_reconcile)
    # The drain's deadline has passed.
    Node.objects.filter(pk=node.pk).update(drain_started_at=timezone.now() - timedelta(hours=1))
    replica = Replica.objects.get(deployment=deployment)
    assert replica.drain_blocked_reason.startswith("a100-1 is the only node of pool a100-us-east")
    return replica


@pytest.mark.parametrize("width", [1280, 390])
def test_a_blocked_drain_asks_to_force_or_cancel_and_force_drains_the_node(
    gateway_server: GatewayServer, blocked_drain: Replica, page: Page, width: int
) -> None:
    node_id = blocked_drain.node_id
    page.set_viewport_size({"width": width, "height": 900})
    log_in(page, gateway_server.url, "ops")
    page.goto(f"{gateway_server.url}/console/fleet/")
    drain = page.locator(f"#drain-{node_id}")
    expect(drain.locator(".drain-question")).to_contain_text("Drain blocked since")
    expect(drain.locator(".drain-question")).to_contain_text(
        "a100-1 is the only node of pool a100-us-east; stopping it would leave deployment "
        "qwen2-5-7b-a100-us-east 0 Ready replicas, under its replicas_min of 1"
    )
    expect(drain.locator(".drain-blockers")).to_contain_text(
        "add a node to pool a100-us-east with at least 1 free GPU"
    )
    expect(drain.locator("button:has-text('Force drain')")).to_be_visible()
    expect(drain.locator("button:has-text('Cancel drain')")).to_be_visible()
    assert_fits(page, "fleet")
    screenshot(page, f"console-drain-blocked-{width}")

    page.once("dialog", lambda dialog: dialog.accept())
    drain.locator("button:has-text('Force drain')").click()
    expect(page.locator(".messages")).to_contain_text("a100-1 drain forced")
    assert Replica.objects.get(pk=blocked_drain.pk).state == Replica.State.DRAINING

    # The agent never confirms the stop: the replica is written off and the node is drained.
    Replica.objects.filter(pk=blocked_drain.pk).update(
        draining_since=timezone.now() - timedelta(minutes=5)
    )
    in_thread(do_reconcile)
    page.goto(f"{gateway_server.url}/console/fleet/")
    expect(page.locator(f"#node-{node_id} .badge")).to_have_text("Drained")
    expect(page.locator(f"#drain-{node_id}")).to_contain_text("no replicas left on it")
    assert_fits(page, "fleet")
    screenshot(page, f"console-drain-done-{width}")
