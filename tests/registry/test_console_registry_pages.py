"""The models page and the deployment API: ready / desired replicas, registering a version from
the console (errors on the form, nothing saved), removing a deployment (refused while a
rollout moves its traffic), and retired deployments that finish draining become stopped."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from registry.actions import (
    do_create_deployment,
    do_finish_drained_deployments,
    do_retire_deployment,
    do_start_rollout,
)
from registry.models import Deployment, Model, ModelVersion, Rollout
from registry.tasks import rollout_tick
from serving.models import GpuPool, Node, Replica
from tests.registry.conftest import approved_version, client_for


def console(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def replica(deployment: Deployment, state: str, phase: str = "colocated") -> Replica:
    node, _ = Node.objects.get_or_create(
        pool=deployment.pool, hostname="n1", defaults={"agent_url": "http://n1:9100"}
    )
    return Replica.objects.create(
        deployment=deployment,
        node=node,
        gpu_indices=[Replica.objects.count()],
        state=state,
        phase=phase,
    )


@pytest.fixture
def v1(llama_8b: Model) -> ModelVersion:
    return approved_version(llama_8b, "v1", "bf16")


@pytest.fixture
def colocated(v1: ModelVersion, pools: dict[str, GpuPool]) -> Deployment:
    deployment = do_create_deployment(
        name="whole", model_version=v1, pool=pools["l4"], replicas_desired=3, replicas_max=3
    )
    replica(deployment, "ready")
    replica(deployment, "ready")
    replica(deployment, "starting")
    replica(deployment, "stopped")
    return deployment


@pytest.fixture
def split(v1: ModelVersion, pools: dict[str, GpuPool]) -> Deployment:
    deployment = do_create_deployment(
        name="split",
        model_version=v1,
        pool=pools["h100"],
        decode_pool=pools["h200"],
        kv_connector="nixl",
        replicas_desired=1,
        decode_replicas_desired=2,
        decode_replicas_max=2,
    )
    replica(deployment, "ready", "prefill")
    replica(deployment, "ready", "decode")
    replica(deployment, "failed", "decode")
    return deployment


# --- ready / desired ------------------------------------------------------------------------


def test_the_api_gives_ready_over_desired_for_each_phase(
    staff: Any, colocated: Deployment, split: Deployment
) -> None:
    listed = {d["name"]: d for d in client_for(staff).get("/api/v1/deployments/").json()["results"]}
    whole = listed["whole"]
    assert (whole["ready_replicas"], whole["replicas_desired"]) == (2, 3)
    assert whole["decode_ready_replicas"] is None
    disaggregated = listed["split"]
    assert (disaggregated["ready_replicas"], disaggregated["replicas_desired"]) == (1, 1)
    assert (disaggregated["decode_ready_replicas"], disaggregated["decode_replicas_desired"]) == (
        1,
        2,
    )
    one = client_for(staff).get(f"/api/v1/deployments/{split.pk}/").json()
    assert (one["ready_replicas"], one["decode_ready_replicas"]) == (1, 1)


def test_the_deployment_list_counts_ready_replicas_in_one_query(
    staff: Any,
    colocated: Deployment,
    split: Deployment,
    django_assert_max_num_queries: Any,
) -> None:
    client = client_for(staff)
    client.get("/api/v1/deployments/")  # the session and the user, once
    with django_assert_max_num_queries(8):
        client.get("/api/v1/deployments/")


def test_the_models_page_shows_ready_over_desired(
    staff: Any, colocated: Deployment, split: Deployment
) -> None:
    page = console(staff).get("/console/models/").content.decode()
    whole = page[page.index(f'id="deployment-{colocated.pk}"') :]
    assert '<td class="ready-desired">2 / 3</td>' in whole
    disaggregated = page[page.index(f'id="deployment-{split.pk}"') :]
    assert '<td class="ready-desired">prefill 1 / 1<br>decode 1 / 2</td>' in disaggregated


# --- draining -> stopped --------------------------------------------------------------------


def test_a_draining_deployment_whose_replicas_are_gone_becomes_stopped(
    colocated: Deployment,
) -> None:
    do_retire_deployment(colocated)
    rollout_tick.apply()
    colocated.refresh_from_db()
    assert colocated.status == Deployment.Status.DRAINING  # replicas still there

    colocated.replicas.update(state="draining")
    assert do_finish_drained_deployments() == []
    colocated.replicas.update(state="stopped")
    rollout_tick.apply()
    colocated.refresh_from_db()
    assert colocated.status == Deployment.Status.STOPPED
    assert do_finish_drained_deployments() == []  # nothing left to do


def test_a_draining_deployment_that_never_had_replicas_becomes_stopped(
    v1: ModelVersion, pools: dict[str, GpuPool]
) -> None:
    deployment = do_create_deployment(name="empty", model_version=v1, pool=pools["l4"])
    active_elsewhere = do_create_deployment(name="active", model_version=v1, pool=pools["l4"])
    do_retire_deployment(deployment)
    assert do_finish_drained_deployments() == [deployment.pk]
    deployment.refresh_from_db()
    active_elsewhere.refresh_from_db()
    assert deployment.status == Deployment.Status.STOPPED
    assert active_elsewhere.status == Deployment.Status.ACTIVE


# --- register a version from the console ----------------------------------------------------


def test_staff_register_a_version_from_the_form(staff: Any, llama_8b: Model) -> None:
    reply = console(staff).post(
        "/console/models/versions/create/",
        {
            "model": llama_8b.pk,
            "version": "v7",
            "artifact_uri": "hf://meta-llama/Llama-3.1-8B",
            "revision": "main",
            "quantization": "fp8",
        },
        follow=True,
    )
    assert reply.redirect_chain == [("/console/models/", 302)]
    version = ModelVersion.objects.get(model=llama_8b, version="v7")
    assert (version.status, version.quantization, version.revision) == ("draft", "fp8", "main")
    assert "llama-3.1-8b v7 registered as a draft" in reply.content.decode()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"artifact_uri": "ftp://nowhere"}, "An artifact URI starts with s3://bucket/"),
        ({"version": "Not A Label!"}, "version: Lower-case letters"),
        ({"version": "v" * 65}, "version: Ensure this value has at most 64 characters"),
        ({"quantization": "int3"}, "quantization: Value &#x27;int3&#x27; is not a valid choice"),
        ({"model": "999999"}, "model: Choose a model from the list."),
        ({"model": "nonsense"}, "model: Choose a model from the list."),
        ({"artifact_uri": "file:///etc"}, "inside the platform&#x27;s model root"),
    ],
    ids=["bad-uri", "bad-label", "too-long", "bad-quantization", "no-model", "junk-model", "etc"],
)
def test_a_refused_version_form_says_why_keeps_what_was_typed_and_saves_nothing(
    staff: Any, llama_8b: Model, fields: dict[str, str], message: str
) -> None:
    form = {
        "model": str(llama_8b.pk),
        "version": "v9",
        "artifact_uri": "hf://meta-llama/Llama-3.1-8B",
        "quantization": "bf16",
        **fields,
    }
    reply = console(staff).post("/console/models/versions/create/", form, follow=True)
    assert reply.status_code == 200
    assert reply.redirect_chain == [("/console/models/", 302)]
    page = reply.content.decode()
    assert "Version not registered:" in page
    errors = page[page.index('id="version-errors"') : page.index('id="version-form"')]
    assert message in errors
    assert f'value="{form["artifact_uri"][:500]}"' in page
    assert not ModelVersion.objects.exists()


def test_a_duplicate_version_is_refused_on_the_form(staff: Any, v1: ModelVersion) -> None:
    form = {"model": v1.model_id, "version": "v1", "artifact_uri": "hf://x/y", "quantization": ""}
    page = console(staff).post("/console/models/versions/create/", form, follow=True)
    assert "Version not registered:" in page.content.decode()
    assert "already exists" in page.content.decode()
    assert ModelVersion.objects.count() == 1


def test_a_tenant_member_cannot_register_a_version(acme_user: Any, llama_8b: Model) -> None:
    form = {"model": llama_8b.pk, "version": "v2", "artifact_uri": "hf://x/y"}
    assert console(acme_user).post("/console/models/versions/create/", form).status_code == 403
    assert not ModelVersion.objects.exists()


# --- remove a deployment --------------------------------------------------------------------


def test_staff_remove_a_deployment_and_it_drains(staff: Any, colocated: Deployment) -> None:
    reply = console(staff).post(f"/console/deployments/{colocated.pk}/retire/", follow=True)
    assert reply.redirect_chain == [("/console/models/", 302)]
    colocated.refresh_from_db()
    assert colocated.status == Deployment.Status.DRAINING
    assert "whole removed: out of the routing table, draining" in reply.content.decode()


@pytest.fixture
def live_rollout(
    staff: Any, v1: ModelVersion, llama_8b: Model, pools: dict[str, GpuPool], redis_client: Any
) -> Rollout:
    baseline = do_create_deployment(name="base", model_version=v1, pool=pools["l4"])
    return do_start_rollout(baseline, approved_version(llama_8b, "v2", "bf16"), actor=staff)


@pytest.mark.parametrize("role", ["baseline", "canary"])
def test_removing_a_deployment_of_a_live_rollout_is_refused(
    staff: Any, live_rollout: Rollout, role: str
) -> None:
    deployment = getattr(live_rollout, role)
    reply = console(staff).post(f"/console/deployments/{deployment.pk}/retire/", follow=True)
    page = reply.content.decode()
    assert f"{deployment.name} not removed: {deployment.name} is the {role} of rollout" in page
    assert "abort or finish the rollout first" in page
    deployment.refresh_from_db()
    assert deployment.status == Deployment.Status.ACTIVE
    # The page offers no Remove button for it.
    row = page[page.index(f'id="deployment-{deployment.pk}"') :].split("</tr>")[0]
    assert "in a rollout" in row and "Remove" not in row


def test_the_api_retire_is_the_same_action(staff: Any, live_rollout: Rollout) -> None:
    refused = client_for(staff).post(f"/api/v1/deployments/{live_rollout.canary_id}/retire/")
    assert refused.status_code == 400
    assert "abort or finish the rollout first" in str(refused.json())
    other = do_create_deployment(
        name="other",
        model_version=live_rollout.baseline.model_version,
        pool=live_rollout.baseline.pool,
    )
    retired = client_for(staff).post(f"/api/v1/deployments/{other.pk}/retire/")
    assert retired.status_code == 200
    assert retired.json()["status"] == "draining"
    again = client_for(staff).post(f"/api/v1/deployments/{other.pk}/retire/")
    assert again.status_code == 400 and "already draining" in str(again.json())


def test_another_tenants_member_cannot_remove_a_deployment(
    acme_user: Any, colocated: Deployment
) -> None:
    assert (
        console(acme_user).post(f"/console/deployments/{colocated.pk}/retire/").status_code == 403
    )
    assert client_for(acme_user).post(
        f"/api/v1/deployments/{colocated.pk}/retire/"
    ).status_code in (
        403,
        404,
    )
    colocated.refresh_from_db()
    assert colocated.status == Deployment.Status.ACTIVE
