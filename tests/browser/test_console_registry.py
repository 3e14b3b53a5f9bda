"""The models page in a real browser, on a desktop and on a phone: register a version (and
see a refused one say why), a deployment pending capacity with its reason and since when,
ready / desired replicas, the live placement check, and removing a deployment; the page
fits a 390 px screen."""

from __future__ import annotations

import pytest
import redis
from playwright.sync_api import Page, expect

from registry.actions import do_create_deployment
from registry.models import Deployment, ModelVersion
from serving.models import Gpu, GpuClass, GpuPool, Node, Replica
from tests.browser.conftest import assert_fits, log_in, make_user, screenshot
from tests.gateway.conftest import GatewayServer
from tests.registry.conftest import approved_version, make_model

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def fleet_rows(gpu_classes: None, redis_client: redis.Redis) -> dict[str, Deployment]:
    """A pool of one node with two GPUs: an 8B deployment serves from one, and a 70B at TP 4
    waits for a node with four free."""
    pool = GpuPool.objects.create(
        name="h100-us-east", gpu_class=GpuClass.objects.get(name="H100-SXM-80GB"), region="us-east"
    )
    node = Node.objects.create(pool=pool, hostname="n1", agent_url="http://n1:9100")
    for index in range(2):
        Gpu.objects.create(
            node=node, index=index, uuid=f"GPU-{index}", name="H100", memory_mb=81920
        )
    small = do_create_deployment(
        name="llama-8b-h100",
        model_version=approved_version(make_model("llama-3.1-8b"), "v1", "bf16"),
        pool=pool,
    )
    Replica.objects.create(
        deployment=small, node=node, gpu_indices=[0], state=Replica.State.READY, port=18001
    )
    big = do_create_deployment(
        name="llama-70b-h100",
        model_version=approved_version(make_model("llama-3.1-70b"), "v1", "bf16"),
        pool=pool,
        tensor_parallel=4,
    )
    assert big.pending_capacity
    make_user("ops", is_staff=True)
    return {"small": small, "big": big}


@pytest.mark.parametrize("width", [1280, 390])
def test_the_models_page_registers_versions_shows_capacity_and_removes_deployments(
    gateway_server: GatewayServer, fleet_rows: dict[str, Deployment], page: Page, width: int
) -> None:
    small, big = fleet_rows["small"], fleet_rows["big"]
    page.set_viewport_size({"width": width, "height": 900})
    log_in(page, gateway_server.url, "ops")
    page.goto(f"{gateway_server.url}/console/models/")

    big_row = page.locator(f"#deployment-{big.pk}")
    expect(big_row.locator(".deployment-status")).to_contain_text("pending capacity")
    expect(big_row.locator(".deployment-status")).to_contain_text(
        "pool h100-us-east: no node has 4 free GPUs; largest free is 1 on node n1"
    )
    expect(big_row.locator(".deployment-status")).to_contain_text("since ")
    expect(big_row.locator(".ready-desired")).to_have_text("0 / 1")
    expect(page.locator(f"#deployment-{small.pk} .ready-desired")).to_have_text("1 / 1")
    assert_fits(page, "models (deployments)")

    # The live check says the same before anything is saved.
    form = page.locator("form[hx-post]")
    form.locator("select[name=model_version]").select_option(label="llama-3.1-70b v1 (bf16)")
    form.locator("select[name=tensor_parallel]").select_option("4")
    expect(page.locator("#placement")).to_contain_text("Pending capacity")
    expect(page.locator("#placement")).to_contain_text("no node has 4 free GPUs")
    assert_fits(page, "models (placement check)")

    # A refused version says why on the form and keeps what was typed.
    versions = page.locator("#version-form")
    versions.locator("select[name=model]").select_option(label="llama-3.1-70b")
    versions.locator("input[name=version]").fill("v2")
    versions.locator("input[name=artifact_uri]").fill("ftp://nowhere/llama")
    versions.locator("button[type=submit]").click()
    expect(page.locator(".messages")).to_contain_text("Version not registered")
    expect(page.locator("#version-errors")).to_contain_text("An artifact URI starts with s3://")
    expect(page.locator("#version-form input[name=artifact_uri]")).to_have_value(
        "ftp://nowhere/llama"
    )
    assert not ModelVersion.objects.filter(version="v2").exists()
    assert_fits(page, "models (refused version)")

    versions.locator("input[name=artifact_uri]").fill("hf://meta-llama/Llama-3.1-70B-Instruct")
    versions.locator("button[type=submit]").click()
    expect(page.locator(".messages")).to_contain_text("llama-3.1-70b v2 registered as a draft")
    assert ModelVersion.objects.get(version="v2").status == ModelVersion.Status.DRAFT
    screenshot(page, f"console-models-{width}")

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator(f"#deployment-{big.pk} button:has-text('Remove')").click()
    expect(page.locator(".messages")).to_contain_text("llama-70b-h100 removed")
    expect(page.locator(f"#deployment-{big.pk} .deployment-status")).to_have_text("draining")
    assert Deployment.objects.get(pk=big.pk).status == Deployment.Status.DRAINING
    assert_fits(page, "models (after removal)")
