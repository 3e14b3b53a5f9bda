"""A held rollout in a real browser, on a desktop and on a phone: the page says the canary's
weight is held at 0 %, why and since when, and fits a 390 px screen."""

from __future__ import annotations

import pytest
import redis
from playwright.sync_api import Page, expect

from registry.actions import do_create_deployment, do_start_rollout
from registry.models import Rollout
from registry.tasks import rollout_tick
from serving.actions.reconcile import do_reconcile
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from tests.browser.conftest import assert_fits, in_thread, log_in, make_user, screenshot
from tests.gateway.conftest import GatewayServer
from tests.registry.conftest import approved_version, make_model

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def held_rollout(gpu_classes: None, redis_client: redis.Redis) -> Rollout:
    """The issue's rollout: qwen2.5-7b v1 -> v2 on a pool of one GPU, which v1 holds."""
    pool = GpuPool.objects.create(
        name="a100-us-east", gpu_class=GpuClass.objects.get(name="A100-SXM-80GB"), region="us-east"
    )
    node = Node.objects.create(pool=pool, hostname="a100-1", agent_url="http://a100-1:9100")
    Gpu.objects.create(node=node, index=0, uuid="GPU-0", name="A100", memory_mb=81920)
    model = make_model("qwen2.5-7b")
    baseline = do_create_deployment(
        name="qwen2-5-7b-a100-us-east",
        model_version=approved_version(model, "v1", "bf16"),
        pool=pool,
    )
    in_thread(do_reconcile)
    Replica.objects.filter(deployment=baseline).update(state=Replica.State.READY, port=18001)
    staff = make_user("ops", is_staff=True)
    rollout = do_start_rollout(
        baseline, approved_version(model, "v2", "bf16"), actor=staff, step_min_requests=20
    )
    in_thread(do_reconcile)
    in_thread(rollout_tick.apply)
    rollout.refresh_from_db()
    assert rollout.canary_state == "no_room"
    return rollout


@pytest.mark.parametrize("width", [1280, 390])
def test_a_held_rollout_shows_its_hold_and_reason_and_fits_the_screen(
    gateway_server: GatewayServer, held_rollout: Rollout, page: Page, width: int
) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    log_in(page, gateway_server.url, "ops")
    page.goto(f"{gateway_server.url}/console/rollouts/")
    expect(page.locator("#gate-minimum")).to_contain_text("before 50 canary requests")
    assert_fits(page, "rollouts")

    page.goto(f"{gateway_server.url}/console/rollouts/{held_rollout.pk}/")
    expect(page.locator("#rollout-state")).to_have_text("running")
    expect(page.locator("#canary-state")).to_have_text("canary no room")
    expect(page.locator("#rollout-weight")).to_have_text("0 %")
    held = page.locator("#rollout-held")
    expect(held).to_contain_text("Canary weight held at 0 % since")
    expect(page.locator("#held-reason")).to_have_text(
        "no room for a canary replica: needs 1 free GPU on one node; its pool has 0 free on 1 node"
    )
    expect(page.locator("#gate-minimum")).to_contain_text("No verdict before 50 canary requests")
    assert_fits(page, "rollout")
    screenshot(page, f"console-rollout-held-{width}")

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("button:has-text('Promote')")
    expect(page.locator(".messages")).to_contain_text("The canary has no ready replica")
    assert Rollout.objects.get(pk=held_rollout.pk).state == Rollout.State.RUNNING
