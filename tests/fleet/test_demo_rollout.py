"""The rollout the start-up banner suggests runs to promotion on demo-sized traffic.

The banner's line is read from var/demo.json as `make run` prints it; the rollout is started
over REST with the demo's staff API token, exactly as the README tells a newcomer; the
controller (the Celery task `rollout_tick`) then steps and promotes it on the canary requests
the gateway would record. Step durations are honoured by moving the step's start back, not by
waiting a minute.
"""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import redis
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from pytest_django import Settings

from registry.models import Deployment, Rollout
from registry.tasks import rollout_tick
from serving import demo
from tests.registry.test_rollouts import ready_replica
from tests.registry.test_rollouts_honest import _serve


def _seed(var: Path) -> dict[str, Any]:
    call_command("seed_demo", stdout=StringIO())
    details: dict[str, Any] = json.loads((var / "demo.json").read_text())
    return details


def _suggested_body(details: dict[str, Any]) -> dict[str, Any]:
    line = details["extra"]["Rollout to try"]
    body = line.split("POST /api/v1/rollouts/ ", 1)[1].split(" with the staff API token", 1)[0]
    parsed: dict[str, Any] = json.loads(body)
    return parsed


def _step_done_a_while_ago(rollout: Rollout) -> None:
    """As if the step's minimum duration had passed."""
    Rollout.objects.filter(pk=rollout.pk).update(
        step_started_at=timezone.now() - timedelta(seconds=rollout.step_min_duration_s + 1)
    )


def test_the_banners_rollout_runs_to_promotion_on_demo_traffic(
    gpu_classes: None, tmp_path: Path, settings: Settings, redis_client: redis.Redis
) -> None:
    settings.PLATFORM_VAR_DIR = tmp_path
    details = _seed(tmp_path)
    body = _suggested_body(details)
    assert body["steps"] == demo.DEMO_ROLLOUT["steps"]
    baseline = Deployment.objects.get(pk=body["baseline"])
    assert baseline.model_version.model.name == "qwen2.5-7b"
    ready_replica(baseline)

    api = Client(headers={"authorization": f"Bearer {details['staff_token']}"})
    started = api.post("/api/v1/rollouts/", body, content_type="application/json")
    assert started.status_code == 201, started.json()
    rollout = Rollout.objects.get(pk=started.json()["id"])
    ready_replica(rollout.canary)  # what the node agent reports once the canary's engine answers

    seen_weights = []
    for _ in range(len(body["steps"]) + 1):
        rollout_tick.apply()
        rollout.refresh_from_db()
        if rollout.state == Rollout.State.PROMOTED:
            break
        seen_weights.append(Deployment.objects.get(pk=rollout.canary_id).traffic_weight)
        # The step's share of about 1 request/s over the demo's models, on each side.
        _serve(redis_client, rollout.canary_id, body["step_min_requests"])
        _serve(redis_client, rollout.baseline_id, body["step_min_requests"])
        _step_done_a_while_ago(rollout)

    assert rollout.state == Rollout.State.PROMOTED, rollout.last_decision
    assert seen_weights == [50, 100]
    assert Deployment.objects.get(pk=rollout.canary_id).traffic_weight == 100
    assert Deployment.objects.get(pk=rollout.baseline_id).status == Deployment.Status.DRAINING

    # The next start-up suggests nothing more: qwen2.5-7b's approved versions are all served.
    again = _seed(tmp_path)
    assert "Rollout to try" not in again["extra"]
    assert again["staff_token"] == details["staff_token"]  # the same token while it works
