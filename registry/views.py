"""Console pages of the registry: models, versions, adapters, deployments and rollouts."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db.models import Sum
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from config.ids import row_id
from config.loops import loop_failures
from config.redis import redis_client
from config.views import staff_required
from registry import actions
from registry.models import (
    Adapter,
    Deployment,
    Model,
    ModelVersion,
    Quantization,
    Rollout,
    SloTier,
    pools,
)
from registry.placement import (
    check_deployment_capacity,
    check_deployment_placement,
    check_kv_connector,
)
from registry.rollout_policy import GateThresholds

# What a refused version form typed, handed to the page it redirects to.
VERSION_FORM_SESSION_KEY = "console_version_form"

ROLLOUT_ACTIONS: dict[str, Callable[..., Rollout]] = {
    "pause": actions.do_pause_rollout,
    "resume": actions.do_resume_rollout,
    "abort": actions.do_abort_rollout,
    "promote": actions.do_promote_rollout,
    "advance": actions.do_advance_rollout_step,
}


def _errors_text(error: ValidationError) -> list[str]:
    if hasattr(error, "message_dict"):
        return [
            msg if field == NON_FIELD_ERRORS else f"{field}: {msg}"
            for field, msgs in error.message_dict.items()
            for msg in msgs
        ]
    return list(error.messages)


def _int(data: QueryDict, name: str, default: int) -> int:
    try:
        return int(data.get(name) or default)
    except ValueError:
        return default


def _deployment_from(data: QueryDict) -> Deployment:
    """An unsaved deployment from the form, for the placement check and for saving."""
    # A form's choices of rows are ids (config.ids), not any text a client sends.
    version_pk, pool_pk = row_id(data.get("model_version")), row_id(data.get("pool"))
    if version_pk is None or pool_pk is None:
        raise ValidationError("Choose a model version and a pool.")
    version = ModelVersion.objects.select_related("model").filter(pk=version_pk)
    pool = pools().filter(pk=pool_pk)
    if not version.exists() or not pool.exists():
        raise ValidationError("Choose a model version and a pool.")
    engine_args: dict[str, Any] = {"max_model_len": _int(data, "max_model_len", 8192)}
    if gpu_memory_utilization := data.get("gpu_memory_utilization"):
        try:
            utilization = float(gpu_memory_utilization)
        except ValueError:
            utilization = math.nan
        if not 0 < utilization <= 1:
            raise ValidationError("GPU memory utilization must be a number above 0, at most 1.")
        engine_args["gpu_memory_utilization"] = utilization
    # Disaggregated: a decode pool chosen (blank: colocated, the pool runs whole requests).
    decode_pool = None
    if data.get("decode_pool"):
        decode_pk = row_id(data.get("decode_pool"))
        decode_pool = None if decode_pk is None else pools().filter(pk=decode_pk).first()
        if decode_pool is None:
            raise ValidationError("Choose a decode pool from the list, or none.")
    phases: dict[str, Any] = {}
    if decode_pool is not None:
        phases = {
            "decode_pool": decode_pool,
            "decode_replicas_min": _int(data, "decode_replicas_min", 1),
            "decode_replicas_max": _int(data, "decode_replicas_max", 1),
            "decode_replicas_desired": _int(data, "decode_replicas_desired", 1),
            "kv_connector": data.get("kv_connector", ""),
        }
    return Deployment(
        **phases,
        name=data.get("name", "").strip(),
        model_version=version.get(),
        pool=pool.get(),
        tensor_parallel=_int(data, "tensor_parallel", 1),
        replicas_min=_int(data, "replicas_min", 1),
        replicas_max=_int(data, "replicas_max", 1),
        replicas_desired=_int(data, "replicas_desired", 1),
        engine_args=engine_args,
        slo_tier=data.get("slo_tier") or SloTier.STANDARD,
    )


@staff_required
def models_page(request: HttpRequest) -> HttpResponse:
    deployments = list(
        actions.with_ready_replicas(
            Deployment.objects.select_related("model_version__model", "pool", "decode_pool")
        )
    )
    failing = loop_failures(redis_client(), "deployment")
    for deployment in deployments:
        deployment.loop_failures = failing.get(deployment.pk, [])  # type: ignore[attr-defined]
    live_rollouts = actions.rollouts_for_user(request.user).filter(state__in=Rollout.LIVE_STATES)
    in_rollout = {
        pk for pair in live_rollouts.values_list("baseline_id", "canary_id") for pk in pair
    }
    context = {
        "models": Model.objects.prefetch_related("versions", "granted_tenants"),
        "adapters": Adapter.objects.select_related("base_version__model", "owner_tenant"),
        "deployments": deployments,
        "in_rollout": in_rollout,
        "approved_versions": ModelVersion.objects.filter(
            status=ModelVersion.Status.APPROVED
        ).select_related("model"),
        "pools": pools(),
        "slo_tiers": SloTier.choices,
        "kv_connectors": Deployment.KvConnector.choices,
        "quantizations": Quantization.choices,
        "version_form": request.session.pop(VERSION_FORM_SESSION_KEY, None),
    }
    return render(request, "console/models.html", context)


VERSION_FORM_FIELDS = ("version", "artifact_uri", "revision", "quantization")


@staff_required
@require_POST
def create_version(request: HttpRequest) -> HttpResponse:
    """Register a draft version of a model: the API's write (do_create_version), its errors on
    the form with what was typed, nothing saved."""
    typed = {name: request.POST.get(name, "").strip() for name in VERSION_FORM_FIELDS}
    typed["quantization"] = typed["quantization"] or Quantization.BF16
    model_pk = request.POST.get("model", "")
    try:
        try:
            model = actions.access_model(request.user, model_pk)
        except Http404:
            raise ValidationError({"model": ["Choose a model from the list."]}) from None
        version = actions.do_create_version(model, **typed)
    except ValidationError as error:
        errors = _errors_text(error)
        messages.error(request, "Version not registered: " + "; ".join(errors))
        # Cut to what the fields hold, so a huge paste does not fill the session.
        request.session[VERSION_FORM_SESSION_KEY] = {
            "model": model_pk[:20],
            **{name: value[:500] for name, value in typed.items()},
            "errors": errors,
        }
        return redirect("console-models")
    messages.info(
        request, f"{model.name} {version.version} registered as a draft: approve it to deploy it."
    )
    return redirect("console-models")


@staff_required
@require_POST
def approve_version(request: HttpRequest, version_id: int) -> HttpResponse:
    version = actions.access_version(request.user, version_id)
    try:
        actions.do_approve_version(version, actor=request.user)
        messages.info(request, f"{version.model.name} {version.version} approved.")
    except ValidationError as error:
        messages.error(request, "; ".join(_errors_text(error)))
    return redirect("console-models")


@staff_required
@require_POST
def placement_check(request: HttpRequest) -> HttpResponse:
    """The form's live answer, before anything is saved: does the model fit the pool's GPUs,
    and do the pool's nodes have room for its replicas now (else it would wait, pending
    capacity)."""
    capacity = None
    try:
        deployment = _deployment_from(request.POST)
        problems = actions.check_engine_args(deployment.engine_args)
        problems += check_kv_connector(deployment)
        result = None if problems else check_deployment_placement(deployment)
        if result is not None and result.ok:
            capacity = check_deployment_capacity(deployment)
    except (ValidationError, ValueError) as error:
        problems, result = [str(getattr(error, "message", error))], None
    return render(
        request,
        "console/placement_result.html",
        {"problems": problems, "result": result, "capacity": capacity},
    )


@staff_required
@require_POST
def create_deployment(request: HttpRequest) -> HttpResponse:
    try:
        deployment = _deployment_from(request.POST)
        # What the form sets; a blank name is left for the action to choose.
        names = actions.DEPLOYMENT_FIELDS - {"status", "traffic_weight", "name"}
        fields = {name: getattr(deployment, name) for name in names}
        if deployment.name:
            fields["name"] = deployment.name
        created = actions.do_create_deployment(**fields)
    except ValidationError as error:
        messages.error(request, "Not created: " + "; ".join(_errors_text(error)))
        return redirect("console-models")
    if created.pending_capacity:
        messages.warning(
            request,
            f"Deployment {created.name} created, pending capacity: {created.placement_failure}. "
            "Its replicas start when the fleet has room.",
        )
    else:
        messages.info(request, f"Deployment {created.name} created.")
    return redirect("console-models")


@staff_required
@require_POST
def retire_deployment(request: HttpRequest, deployment_id: int) -> HttpResponse:
    """Remove a deployment from service: it drains, then stops (the API's retire)."""
    deployment = actions.access_deployment(request.user, deployment_id)
    try:
        actions.do_retire_deployment(deployment)
    except ValidationError as error:
        messages.error(request, f"{deployment.name} not removed: " + "; ".join(error.messages))
        return redirect("console-models")
    messages.info(
        request,
        f"{deployment.name} removed: out of the routing table, draining; it stops once its "
        "replicas have.",
    )
    return redirect("console-models")


@staff_required
def rollouts_page(request: HttpRequest) -> HttpResponse:
    rollouts = actions.rollouts_for_user(request.user).select_related("model", "baseline", "canary")
    baselines = (
        actions.visible_deployments_for_user(request.user)
        .filter(status=Deployment.Status.ACTIVE, traffic_weight__gt=0)
        .select_related("model_version__model", "pool")
    )
    versions = (
        actions.visible_versions_for_user(request.user)
        .filter(status=ModelVersion.Status.APPROVED)
        .select_related("model")
    )
    return render(
        request,
        "console/rollouts.html",
        {
            "rollouts": rollouts,
            "baselines": baselines,
            "versions": versions,
            "gate_min_requests": GateThresholds().min_requests,
        },
    )


@staff_required
@require_POST
def start_rollout(request: HttpRequest) -> HttpResponse:
    """Start a canary rollout from a deployment to another approved version of its model."""
    try:
        baseline = actions.access_deployment(request.user, request.POST.get("baseline", ""))
        target = actions.access_version(request.user, request.POST.get("target_version", ""))
        rollout = actions.do_start_rollout(
            baseline,
            target,
            actor=request.user,
            step_min_duration_s=_int(request.POST, "step_min_duration_s", 300),
            step_min_requests=_int(request.POST, "step_min_requests", 200),
            cohort_by_tenant=request.POST.get("cohort_by_tenant") == "on",
        )
    except ValidationError as error:
        messages.error(request, "Not started: " + "; ".join(_errors_text(error)))
        return redirect("console-rollouts")
    except Http404:  # a choice that is no id of a row (config.ids), or of none shown
        messages.error(request, "Not started: choose a baseline and a target version.")
        return redirect("console-rollouts")
    messages.info(
        request,
        f"Rollout {rollout.pk} started: the canary is held at 0 % until it has a ready replica, "
        f"then takes {rollout.canary_weight} %.",
    )
    return redirect("console-rollout", rollout_id=rollout.pk)


@staff_required
def rollout_detail(request: HttpRequest, rollout_id: int) -> HttpResponse:
    rollout = actions.access_rollout(request.user, rollout_id)
    transitions = rollout.transitions.order_by("-created_at")
    gate = (rollout.last_decision or {}).get("gate") or {}
    # Shares of the model's whole traffic: a model on several pools has weights summing past
    # 100, and its other pools keep theirs while this rollout moves the baseline's share.
    total = (
        Deployment.objects.filter(
            model_version__model=rollout.model, status=Deployment.Status.ACTIVE
        ).aggregate(total=Sum("traffic_weight"))["total"]
        or 0
    )
    return render(
        request,
        "console/rollout.html",
        {
            "rollout": rollout,
            "canary_share": _share(rollout.canary.traffic_weight, total),
            "baseline_share": _share(rollout.baseline.traffic_weight, total),
            "transitions": transitions,
            "decision": rollout.last_decision,
            "gate": gate,
            "live": rollout.state in Rollout.LIVE_STATES,
        },
    )


def _share(weight: int, total: int) -> str:
    """A deployment's weight as a percentage of its model's, to the nearest whole one."""
    return f"{round(100 * weight / total)}" if total else "0"


@staff_required
@require_POST
def rollout_action(request: HttpRequest, rollout_id: int, action: str) -> HttpResponse:
    rollout = actions.access_rollout(request.user, rollout_id)
    act = ROLLOUT_ACTIONS.get(action)
    if act is None:
        raise Http404("No such action.")
    reason = request.POST.get("reason", "").strip()
    try:
        act(rollout, actor=request.user, reason=reason)
        messages.info(request, f"Rollout {rollout.pk}: {action} done.")
    except ValidationError as error:
        messages.error(request, "; ".join(_errors_text(error)))
    return redirect("console-rollout", rollout_id=rollout.pk)
