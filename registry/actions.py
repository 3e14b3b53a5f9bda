"""Every write of the registry (`do_*`) and its permission-checked lookups (`access_*`).

Views, viewsets, the rollout controller and the demo call these and nothing else.

Visibility: a model is visible to a tenant when it is public or granted to the tenant. An
adapter is visible when its base model is, and it is public, owned by the tenant or granted to
it. A deployment is visible when its model is. Staff see everything. A row that is not visible
is a 404 (Http404), never a 403 that would confirm it exists.

After a change the gateway caches, once the transaction commits:
- visibility: `publish_visibility()` rewrites the Redis hash `{registry:visibility}` (see below);
- traffic weights: the task `serving.publish_routing_table` is enqueued by name (the registry
  never imports the fleet), so a rollback reaches the gateways at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import redis
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from config.ids import one_row
from config.jobs import enqueue_on_commit
from config.redis import redis_client
from registry.models import (
    DEFAULT_ENGINE_ARGS,
    Adapter,
    Deployment,
    Model,
    ModelVersion,
    Rollout,
    RolloutTransition,
    Visibility,
)
from registry.placement import (
    check_deployment_capacity,
    check_deployment_placement,
    check_kv_connector,
)
from registry.rollout_metrics import RedisRolloutMetrics, RolloutMetricsSource
from registry.rollout_policy import (
    DEFAULT_STEPS,
    CanaryReplicas,
    CanaryState,
    GateThresholds,
    canary_condition,
    evaluate_gates,
    promotion_refusal,
    validate_steps,
)
from serving.engine.specs import KV_BYTES_PER_ELEMENT
from serving.redis_contracts import VISIBILITY_HASH, VISIBILITY_VERSION_KEY
from tenants.actions import require_staff, tenants_for_user

logger = logging.getLogger(__name__)

# field = served name (model or adapter), value = JSON {"kind", "base_model", "public",
# "tenants"}; for an adapter "public" means "to whoever sees its base model". The version
# counter lets a gateway skip re-reading an unchanged hash.


# ---------------------------------------------------------------- visibility and access_*


def _granted_to(tenant_ids: Any, prefix: str = "") -> Q:
    return Q(**{f"{prefix}visibility": Visibility.PUBLIC}) | Q(
        **{f"{prefix}granted_tenants__in": tenant_ids}
    )


def visible_models_for_tenant(tenant_id: int) -> QuerySet[Model]:
    return Model.objects.filter(pk__in=Model.objects.filter(_granted_to([tenant_id])).values("pk"))


def _tenant_ids_for(user: Any) -> QuerySet[Any]:
    return tenants_for_user(user).values("pk")


def _is_staff(user: Any) -> bool:
    return bool(getattr(user, "is_staff", False))


def visible_models_for_user(user: Any) -> QuerySet[Model]:
    if _is_staff(user):
        return Model.objects.all()
    visible = Model.objects.filter(_granted_to(_tenant_ids_for(user))).values("pk")
    return Model.objects.filter(pk__in=visible)


def visible_versions_for_user(user: Any) -> QuerySet[ModelVersion]:
    versions = ModelVersion.objects.select_related("model")
    if _is_staff(user):
        return versions
    # Tenants see what they could call: no drafts, nothing retired.
    return versions.filter(
        model__in=visible_models_for_user(user),
        status__in=[ModelVersion.Status.APPROVED, ModelVersion.Status.DEPRECATED],
    )


def _visible_adapters(tenant_ids: Any, models: QuerySet[Model]) -> QuerySet[Adapter]:
    own_or_granted = Q(owner_tenant__in=tenant_ids) | _granted_to(tenant_ids)
    visible = Adapter.objects.filter(own_or_granted, base_version__model__in=models).values("pk")
    return Adapter.objects.filter(pk__in=visible)


def visible_adapters_for_tenant(tenant_id: int) -> QuerySet[Adapter]:
    return _visible_adapters([tenant_id], visible_models_for_tenant(tenant_id))


def visible_adapters_for_user(user: Any) -> QuerySet[Adapter]:
    adapters = (
        Adapter.objects.all()
        if _is_staff(user)
        else _visible_adapters(_tenant_ids_for(user), visible_models_for_user(user))
    )
    return adapters.select_related("base_version__model", "owner_tenant")


def visible_deployments_for_user(user: Any) -> QuerySet[Deployment]:
    deployments = Deployment.objects.select_related("model_version__model", "pool__gpu_class")
    if _is_staff(user):
        return deployments
    return deployments.filter(model_version__model__in=visible_models_for_user(user))


def rollouts_for_user(user: Any) -> QuerySet[Rollout]:
    if not _is_staff(user):
        return Rollout.objects.none()
    return Rollout.objects.select_related("model", "baseline", "canary")


def access_model(user: Any, model_id: int | str) -> Model:
    return one_row(visible_models_for_user(user), model_id, "model")


def access_version(user: Any, version_id: int | str) -> ModelVersion:
    return one_row(visible_versions_for_user(user), version_id, "model version")


def access_adapter(user: Any, adapter_id: int | str) -> Adapter:
    return one_row(visible_adapters_for_user(user), adapter_id, "adapter")


def access_deployment(user: Any, deployment_id: int | str) -> Deployment:
    return one_row(visible_deployments_for_user(user), deployment_id, "deployment")


def access_rollout(user: Any, rollout_id: int | str) -> Rollout:
    return one_row(rollouts_for_user(user), rollout_id, "rollout")


def is_name_visible_to_tenant(name: str, tenant_id: int) -> bool:
    """A served model or adapter name the tenant may call (database read; the gateway reads
    the published hash with `published_name_visible` instead)."""
    return (
        visible_models_for_tenant(tenant_id).filter(name=name).exists()
        or visible_adapters_for_tenant(tenant_id).filter(name=name).exists()
    )


# ---------------------------------------------------------------- publishing to Redis


def default_metrics_source() -> RolloutMetricsSource:
    return RedisRolloutMetrics(redis_client(worker=True))


def visibility_entries() -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for model in Model.objects.prefetch_related("granted_tenants"):
        entries[model.name] = {
            "kind": "model",
            "base_model": model.name,
            "public": model.visibility == Visibility.PUBLIC,
            "tenants": sorted(t.pk for t in model.granted_tenants.all()),
            "max_context": model.max_context,
            "created": int(model.created_at.timestamp()),
        }
    adapters = Adapter.objects.select_related("base_version__model").prefetch_related(
        "granted_tenants"
    )
    for adapter in adapters:
        tenants = {t.pk for t in adapter.granted_tenants.all()}
        if adapter.owner_tenant_id is not None:
            tenants.add(adapter.owner_tenant_id)
        entries[adapter.name] = {
            "kind": "adapter",
            "base_model": adapter.base_version.model.name,
            "public": adapter.visibility == Visibility.PUBLIC,
            "tenants": sorted(tenants),
            "created": int(adapter.created_at.timestamp()),
        }
    return entries


def published_name_visible(
    entries: Mapping[str, Mapping[str, Any]], name: str, tenant: int
) -> bool:
    """The gateway's check over the decoded `{registry:visibility}` hash."""
    entry = entries.get(name)
    if entry is None:
        return False
    if not (entry["public"] or tenant in entry["tenants"]):
        return False
    if entry["kind"] == "adapter":
        return published_name_visible(entries, entry["base_model"], tenant)
    return True


def publish_visibility(client: redis.Redis | None = None) -> int:
    client = client or redis_client(worker=True)
    entries = visibility_entries()
    pipe = client.pipeline(transaction=True)
    pipe.delete(VISIBILITY_HASH)
    if entries:
        pipe.hset(VISIBILITY_HASH, mapping={name: json.dumps(e) for name, e in entries.items()})
    pipe.incr(VISIBILITY_VERSION_KEY)
    pipe.execute()
    return len(entries)


def _publish_visibility_quietly() -> None:
    try:
        publish_visibility()
    except redis.RedisError:
        # The periodic republish (registry.publish_visibility) repairs it within a minute.
        logger.warning("could not publish model visibility to Redis", exc_info=True)


def _visibility_changed() -> None:
    transaction.on_commit(_publish_visibility_quietly)


def _weights_changed() -> None:
    enqueue_on_commit("serving.publish_routing_table")


# ---------------------------------------------------------------- models, versions, adapters


def _set_grants(row: Model | Adapter, tenant_ids: Iterable[int] | None) -> None:
    if tenant_ids is not None:
        row.granted_tenants.set(list(tenant_ids))


def _apply(row: Any, changes: Mapping[str, Any], allowed: Collection[str]) -> None:
    unknown = set(changes).difference(allowed)
    if unknown:
        raise ValidationError(f"These fields cannot be changed: {', '.join(sorted(unknown))}.")
    for name, value in changes.items():
        setattr(row, name, value)


# What the model actions may write, in the order the API shows them.
MODEL_FIELDS = (
    "name",
    "family",
    "description",
    "params_b",
    "layers",
    "hidden",
    "kv_heads",
    "head_dim",
    "max_context",
    "visibility",
)


def _save_visible(
    obj: Model | Adapter,
    changes: dict[str, Any],
    allowed: Collection[str],
    granted_tenant_ids: Iterable[int] | None,
) -> Any:
    """The one write path of models and adapters: validate, save, grant, republish who
    may see them."""
    _apply(obj, changes, allowed)
    obj.full_clean()
    obj.save()
    _set_grants(obj, granted_tenant_ids)
    _visibility_changed()
    return obj


@transaction.atomic
def do_create_model(*, granted_tenant_ids: Iterable[int] | None = None, **fields: Any) -> Model:
    model = Model()
    return _save_visible(model, fields, MODEL_FIELDS, granted_tenant_ids)


@transaction.atomic
def do_update_model(
    model: Model, *, granted_tenant_ids: Iterable[int] | None = None, **changes: Any
) -> Model:
    return _save_visible(model, changes, MODEL_FIELDS, granted_tenant_ids)


@transaction.atomic
def do_delete_model(model: Model) -> None:
    if Deployment.objects.filter(model_version__model=model).exists():
        raise ValidationError("Stop and delete this model's deployments first.")
    model.delete()
    _visibility_changed()


VERSION_FIELDS = {"version", "artifact_uri", "revision", "quantization"}


@transaction.atomic
def do_create_version(
    model: Model, *, status: str = ModelVersion.Status.DRAFT, **fields: Any
) -> ModelVersion:
    """A new version, a draft for staff to approve. A seed or an import may register one
    already approved (`status`): there is no reviewer to record, so `approved_by` stays empty."""
    version = ModelVersion(model=model, status=status)
    _apply(version, fields, VERSION_FIELDS)
    version.full_clean()
    version.save()
    return version


@transaction.atomic
def do_update_version(version: ModelVersion, /, **changes: Any) -> ModelVersion:
    # Positional-only: `version` is also a field of the changes (the version's label).
    if version.status != ModelVersion.Status.DRAFT and changes:
        # An approved artifact is what was reviewed; a change is a new version.
        raise ValidationError("Only a draft version can be edited; register a new version.")
    _apply(version, changes, VERSION_FIELDS)
    version.full_clean()
    version.save()
    return version


VERSION_TRANSITIONS: dict[str, set[str]] = {
    ModelVersion.Status.DRAFT: {ModelVersion.Status.APPROVED, ModelVersion.Status.RETIRED},
    ModelVersion.Status.APPROVED: {ModelVersion.Status.DEPRECATED, ModelVersion.Status.RETIRED},
    ModelVersion.Status.DEPRECATED: {ModelVersion.Status.APPROVED, ModelVersion.Status.RETIRED},
    ModelVersion.Status.RETIRED: set(),
}


@transaction.atomic
def do_change_version_status(version: ModelVersion, status: str, *, actor: Any) -> ModelVersion:
    require_staff(actor)
    version = ModelVersion.objects.select_for_update().get(pk=version.pk)
    if status not in VERSION_TRANSITIONS[version.status]:
        raise ValidationError(f"A {version.status} version cannot become {status}.")
    if (
        status == ModelVersion.Status.RETIRED
        and version.deployments.exclude(status=Deployment.Status.STOPPED).exists()
    ):
        raise ValidationError("Stop this version's deployments before retiring it.")
    version.status = status
    if status == ModelVersion.Status.APPROVED:
        version.approved_by = actor
        version.approved_at = timezone.now()
    version.save()
    return version


def do_approve_version(version: ModelVersion, *, actor: Any) -> ModelVersion:
    return do_change_version_status(version, ModelVersion.Status.APPROVED, actor=actor)


ADAPTER_FIELDS = {"name", "base_version", "rank", "artifact_uri", "owner_tenant", "visibility"}


@transaction.atomic
def do_create_adapter(*, granted_tenant_ids: Iterable[int] | None = None, **fields: Any) -> Adapter:
    adapter = Adapter()
    return _save_visible(adapter, fields, ADAPTER_FIELDS, granted_tenant_ids)


@transaction.atomic
def do_update_adapter(
    adapter: Adapter, *, granted_tenant_ids: Iterable[int] | None = None, **changes: Any
) -> Adapter:
    return _save_visible(adapter, changes, ADAPTER_FIELDS, granted_tenant_ids)


@transaction.atomic
def do_delete_adapter(adapter: Adapter) -> None:
    adapter.delete()
    _visibility_changed()


# ---------------------------------------------------------------- deployments


DEPLOYMENT_FIELDS = {
    "name",
    "model_version",
    "pool",
    "tensor_parallel",
    "replicas_min",
    "replicas_max",
    "replicas_desired",
    "decode_pool",
    "decode_replicas_min",
    "decode_replicas_max",
    "decode_replicas_desired",
    "kv_connector",
    "engine_args",
    "slo_tier",
    "status",
    "traffic_weight",
}
PLACEMENT_FIELDS = {
    "model_version",
    "pool",
    "decode_pool",
    "kv_connector",
    "tensor_parallel",
    "engine_args",
}


def check_engine_args(engine_args: Any) -> list[str]:
    """Problems with a deployment's engine arguments; empty when vLLM would accept them."""
    if not isinstance(engine_args, dict):
        return ["Engine arguments are a JSON object."]
    unknown = set(engine_args) - set(DEFAULT_ENGINE_ARGS)
    if unknown:
        return [f"Unknown engine arguments: {', '.join(sorted(unknown))}."]
    args = {**DEFAULT_ENGINE_ARGS, **engine_args}
    problems: list[str] = []
    for name in ("max_model_len", "max_num_seqs", "max_lora_rank"):
        if not isinstance(args[name], int) or isinstance(args[name], bool) or args[name] < 1:
            problems.append(f"{name} is a positive whole number.")
    budget = args["max_num_batched_tokens"]
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            problems.append("max_num_batched_tokens is a positive whole number, or null.")
        elif isinstance(args["max_num_seqs"], int) and budget < args["max_num_seqs"]:
            # vLLM refuses to start otherwise (SchedulerConfig's check).
            problems.append("max_num_batched_tokens is at least max_num_seqs.")
    if not isinstance(args["max_loras"], int) or args["max_loras"] < 0:
        problems.append("max_loras is a whole number, 0 to turn LoRA off.")
    utilization = args["gpu_memory_utilization"]
    if not isinstance(utilization, int | float) or not 0.1 <= utilization <= 0.98:
        problems.append("gpu_memory_utilization is between 0.1 and 0.98.")
    if args["kv_cache_dtype"] not in KV_BYTES_PER_ELEMENT:
        problems.append(f"kv_cache_dtype is one of {', '.join(KV_BYTES_PER_ELEMENT)}.")
    for name in ("enable_prefix_caching", "enable_lora"):
        if not isinstance(args[name], bool):
            problems.append(f"{name} is true or false.")
    return problems


def replica_bound_errors(deployment: Deployment) -> dict[str, list[str]]:
    """The database's check constraints on the replica counts, as fields' errors."""
    errors: dict[str, list[str]] = {}
    for prefix, what in (("", "Replicas"), ("decode_", "Decode replicas")):
        low, desired, high = (
            getattr(deployment, f"{prefix}replicas_{end}") for end in ("min", "desired", "max")
        )
        if not low <= desired <= high:
            errors[f"{prefix}replicas_desired"] = [
                f"{what} must satisfy min <= desired <= max ({low} <= {desired} <= {high})."
            ]
    return errors


def check_deployment(deployment: Deployment) -> None:
    """Field checks, replica bounds and placement; raises ValidationError naming what fits."""
    deployment.full_clean(validate_constraints=False)
    errors = replica_bound_errors(deployment)
    if connector_problems := check_kv_connector(deployment):
        errors["kv_connector"] = connector_problems
    engine_problems = check_engine_args(deployment.engine_args)
    if engine_problems:
        errors["engine_args"] = engine_problems
    else:
        result = check_deployment_placement(deployment)
        if not result.ok:
            errors["placement"] = [result.message]
    if errors:
        raise ValidationError(errors)


@transaction.atomic
def do_create_deployment(**fields: Any) -> Deployment:
    deployment = Deployment()
    _apply(deployment, fields, DEPLOYMENT_FIELDS)
    if not deployment.name:
        deployment.name = _free_deployment_name(deployment)
    if deployment.model_version.status != ModelVersion.Status.APPROVED:
        raise ValidationError({"model_version": ["Only an approved version can be deployed."]})
    check_deployment(deployment)
    _note_capacity(deployment)
    deployment.save()
    _weights_changed()
    return deployment


def _note_capacity(deployment: Deployment) -> None:
    """A deployment whose replicas have no room now is created all the same, pending
    capacity: it says why and since when until the fleet's reconcile places them (a node
    joins, another deployment stops). Only a model that fits no GPU of the pool is refused."""
    capacity = check_deployment_capacity(deployment)
    if capacity.ok:
        deployment.placement_failure, deployment.placement_failure_since = "", None
    else:
        deployment.placement_failure = capacity.message
        deployment.placement_failure_since = timezone.now()


@transaction.atomic
def do_update_deployment(deployment: Deployment, **changes: Any) -> Deployment:
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    if "traffic_weight" in changes and _live_rollout_of(deployment) is not None:
        raise ValidationError(
            {"traffic_weight": ["A rollout owns this deployment's weight; use its actions."]}
        )
    _apply(deployment, changes, DEPLOYMENT_FIELDS)
    if PLACEMENT_FIELDS & set(changes):
        check_deployment(deployment)
    else:
        deployment.full_clean(validate_constraints=False)
        if bounds := replica_bound_errors(deployment):
            raise ValidationError(bounds)
    deployment.save()
    _weights_changed()
    return deployment


def do_scale_deployment(
    deployment: Deployment, replicas_desired: int, *, phase: str = "colocated"
) -> Deployment:
    """The autoscaler's write: one phase's desired replicas (`decode_replicas_desired` for
    "decode", `replicas_desired` otherwise) within that phase's min and max, then a reconcile
    once the transaction commits (the task enqueued by name, as for the routing table).

    A phase the deployment does not have (decode or prefill of a colocated one, colocated of a
    disaggregated one) is a ValidationError. The bounds are checked again in the UPDATE: when
    staff moved them since the row was read, nothing is written (the next beat reads them)."""
    # The phases of serving's Replica.Phase: the registry never imports the fleet.
    phases = ("prefill", "decode") if deployment.disaggregated else ("colocated",)
    if phase not in phases:
        raise ValidationError(f"Deployment {deployment.name} has no {phase} phase to scale.")
    prefix = "decode_" if phase == "decode" else ""
    low, high = (getattr(deployment, f"{prefix}replicas_{end}") for end in ("min", "max"))
    bounded = max(low, min(high, replicas_desired))
    field = f"{prefix}replicas_desired"
    changed = bounded != getattr(deployment, field)
    written = Deployment.objects.filter(
        pk=deployment.pk,
        **{f"{prefix}replicas_min__lte": bounded, f"{prefix}replicas_max__gte": bounded},
    ).update(**{field: bounded, "updated_at": timezone.now()})
    if written:
        setattr(deployment, field, bounded)
        if changed:
            enqueue_on_commit("serving.reconcile")
    return deployment


@transaction.atomic
def do_delete_deployment(deployment: Deployment) -> None:
    if Rollout.objects.filter(Q(baseline=deployment) | Q(canary=deployment)).exists():
        raise ValidationError("This deployment is part of a rollout's history; stop it instead.")
    deployment.delete()
    _weights_changed()


@transaction.atomic
def do_retire_deployment(deployment: Deployment) -> Deployment:
    """Take a deployment out of the routing table and drain its replicas; once none is left
    it becomes stopped (`do_finish_drained_deployments`). Refused while a live rollout moves
    traffic between it and another deployment: abort or finish the rollout first."""
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    rollout = _live_rollout_of(deployment)
    if rollout is not None:
        role = "baseline" if rollout.baseline_id == deployment.pk else "canary"
        raise ValidationError(
            f"{deployment.name} is the {role} of rollout {rollout.pk}, which is "
            f"{rollout.state}: abort or finish the rollout first."
        )
    if deployment.status != Deployment.Status.ACTIVE:
        raise ValidationError(f"{deployment.name} is already {deployment.status}.")
    deployment.status = Deployment.Status.DRAINING
    deployment.placement_failure, deployment.placement_failure_since = "", None
    deployment.save(
        update_fields=["status", "placement_failure", "placement_failure_since", "updated_at"]
    )
    _weights_changed()
    enqueue_on_commit("serving.reconcile")
    return deployment


# serving's Replica.State values of a replica that is still there (all but stopped).
REPLICA_LIVE_STATES = ("pending", "starting", "ready", "failed", "draining")


def do_finish_drained_deployments() -> list[int]:
    """A draining deployment none of whose replicas is left (all stopped, or none ever
    placed) becomes stopped. Idempotent; returns the ids it stopped."""
    drained = Deployment.objects.filter(status=Deployment.Status.DRAINING).exclude(
        replicas__state__in=REPLICA_LIVE_STATES
    )
    ids = list(drained.values_list("pk", flat=True))
    # The UPDATE checks again: a replica placed since the read keeps its deployment draining.
    if ids:
        drained.filter(pk__in=ids).update(
            status=Deployment.Status.STOPPED, updated_at=timezone.now()
        )
    return ids


def _free_deployment_name(deployment: Deployment) -> str:
    version = deployment.model_version
    stem = f"{version.model.name}-{version.version}-{deployment.pool.name}".replace(".", "-")
    stem = stem[:120]
    name, n = stem, 2
    while Deployment.objects.filter(name=name).exists():
        name, n = f"{stem}-{n}", n + 1
    return name


def with_ready_replicas(deployments: QuerySet[Deployment]) -> QuerySet[Deployment]:
    """`ready_replicas` (colocated or prefill) and `decode_ready_replicas` on each row: its
    replicas in serving's Replica.State "ready", per phase, counted in the same query."""
    ready = Q(replicas__state="ready")
    return deployments.annotate(
        ready_replicas=Count("replicas", filter=ready & ~Q(replicas__phase="decode")),
        decode_ready_replicas=Count("replicas", filter=ready & Q(replicas__phase="decode")),
    )


def _live_rollout_of(deployment: Deployment) -> Rollout | None:
    return (
        Rollout.objects.filter(state__in=Rollout.LIVE_STATES)
        .filter(Q(baseline=deployment) | Q(canary=deployment))
        .first()
    )


# ---------------------------------------------------------------- rollouts


def _require_staff_or_controller(actor: Any) -> None:
    # None is the rollout controller; a person must be staff.
    if actor is not None:
        require_staff(actor)


def _actor_label(actor: Any) -> str:
    return actor.get_username() if actor is not None else RolloutTransition.CONTROLLER


def _record(
    rollout: Rollout,
    *,
    from_state: str,
    from_weight: int | None,
    actor: Any,
    reason: str,
    gate: Mapping[str, Any] | None,
) -> RolloutTransition:
    return RolloutTransition.objects.create(
        rollout=rollout,
        from_state=from_state,
        to_state=rollout.state,
        from_weight=from_weight,
        to_weight=rollout.canary.traffic_weight,
        actor=actor,
        actor_label=_actor_label(actor),
        reason=reason,
        gate=dict(gate or {}),
    )


def _set_weights(rollout: Rollout, canary_percent: int) -> None:
    """Give the canary `canary_percent` of the baseline's share of the model's traffic
    weight and the baseline the rest. The share is what the two hold together (the
    baseline's weight when the rollout started: 100 for a model on one deployment), so the
    model's other deployments, on other pools, keep their weights."""
    share = rollout.baseline.traffic_weight + rollout.canary.traffic_weight
    canary_weight = round(share * canary_percent / 100)
    if canary_percent > 0 and share > 0:
        canary_weight = max(1, canary_weight)  # a step is never rounded away
    for deployment, weight in (
        (rollout.canary, canary_weight),
        (rollout.baseline, share - canary_weight),
    ):
        deployment.traffic_weight = weight
        deployment.save(update_fields=["traffic_weight", "updated_at"])
    _weights_changed()


def _locked(rollout: Rollout) -> Rollout:
    return (
        Rollout.objects.select_for_update(of=("self",))
        .select_related("canary", "baseline", "model")
        .get(pk=rollout.pk)
    )


def _require_state(rollout: Rollout, *states: str) -> None:
    if rollout.state not in states:
        raise ValidationError(f"The rollout is {rollout.state}; this needs {' or '.join(states)}.")


@transaction.atomic
def do_start_rollout(
    baseline: Deployment,
    target_version: ModelVersion,
    *,
    actor: Any,
    steps: Iterable[int] = DEFAULT_STEPS,
    step_min_duration_s: int = 300,
    step_min_requests: int = 200,
    gate_thresholds: Mapping[str, Any] | None = None,
    cohort_by_tenant: bool = False,
    metrics: RolloutMetricsSource | None = None,
) -> Rollout:
    """Start moving `baseline`'s traffic to a new deployment of `target_version`, which copies
    the baseline's pool, TP degree, replicas and engine arguments and passes placement."""
    require_staff(actor)
    steps = list(steps)
    problems = validate_steps(steps)
    if problems:
        raise ValidationError({"steps": problems})
    unknown = set(gate_thresholds or {}) - set(GateThresholds().as_dict())
    if unknown:
        raise ValidationError({"gate_thresholds": [f"Unknown: {', '.join(sorted(unknown))}."]})
    baseline = Deployment.objects.select_for_update().get(pk=baseline.pk)
    model = baseline.model_version.model
    _check_rollout_start(baseline, target_version, model)
    canary = Deployment(
        model_version=target_version,
        pool=baseline.pool,
        tensor_parallel=baseline.tensor_parallel,
        replicas_min=baseline.replicas_min,
        replicas_max=baseline.replicas_max,
        replicas_desired=baseline.replicas_desired,
        engine_args=dict(baseline.engine_args),
        slo_tier=baseline.slo_tier,
        status=Deployment.Status.ACTIVE,
        traffic_weight=0,
    )
    canary.name = _free_deployment_name(canary)
    check_deployment(canary)
    _note_capacity(canary)
    canary.save()
    metrics = metrics or default_metrics_source()
    state, canary_reason = canary_condition(CanaryReplicas())
    rollout = Rollout.objects.create(
        model=model,
        baseline=baseline,
        canary=canary,
        steps=steps,
        step_index=0,
        step_started_at=timezone.now(),
        step_min_duration_s=step_min_duration_s,
        step_min_requests=step_min_requests,
        gate_thresholds=dict(gate_thresholds or {}),
        cohort_by_tenant=cohort_by_tenant,
        baseline_mark=metrics.mark(baseline.pk),
        canary_mark=metrics.mark(canary.pk),
        canary_state=state,
        canary_reason=canary_reason,
        canary_since=timezone.now(),
        created_by=actor,
    )
    # The canary has no replica yet: it takes nothing until one is ready (the controller then
    # gives it the first step), so the baseline keeps all of the traffic meanwhile.
    _set_weights(rollout, 0)
    _record(
        rollout,
        from_state="",
        from_weight=0,
        actor=actor,
        reason=(
            f"started: {baseline.model_version} -> {target_version} in steps {steps}; "
            "held at 0 % until the canary has a ready replica"
        ),
        gate=None,
    )
    return rollout


def _check_rollout_start(baseline: Deployment, target: ModelVersion, model: Model) -> None:
    if target.model_id != model.pk:
        raise ValidationError({"target_version": [f"Not a version of {model.name}."]})
    if target.pk == baseline.model_version_id:
        raise ValidationError({"target_version": ["The baseline already serves this version."]})
    if target.status != ModelVersion.Status.APPROVED:
        raise ValidationError({"target_version": ["Only an approved version can be rolled out."]})
    if baseline.status != Deployment.Status.ACTIVE or baseline.traffic_weight <= 0:
        raise ValidationError({"baseline": ["The baseline must be active and take traffic."]})
    # A model served from several pools rolls out pool by pool: this rollout moves the
    # baseline's own share of the model's traffic (`_set_weights`); the other pools' keep
    # theirs until a rollout of their own.
    if Rollout.objects.filter(model=model, state__in=Rollout.LIVE_STATES).exists():
        raise ValidationError({"baseline": [f"{model.name} already has a live rollout."]})


@transaction.atomic
def do_advance_rollout_step(
    rollout: Rollout,
    *,
    actor: Any,
    reason: str = "",
    gate: Mapping[str, Any] | None = None,
    metrics: RolloutMetricsSource | None = None,
) -> Rollout:
    """Move the canary to the next step's weight; from the last step, promote. Refused while
    the canary has no ready replica or the gates have no passing verdict on this step."""
    _require_staff_or_controller(actor)
    rollout = _locked(rollout)
    _require_state(rollout, Rollout.State.RUNNING)
    if rollout.step_index >= len(rollout.steps) - 1:
        return do_promote_rollout(rollout, actor=actor, reason=reason, gate=gate, metrics=metrics)
    _require_serving_and_judged(rollout, metrics)
    reason = reason or "advanced by staff"
    from_weight = rollout.canary.traffic_weight
    rollout.step_index += 1
    _open_step_window(rollout, metrics)
    rollout.save(update_fields=["step_index", "step_started_at", "canary_mark"])
    _set_weights(rollout, rollout.canary_weight)
    _record(
        rollout,
        from_state=rollout.state,
        from_weight=from_weight,
        actor=actor,
        reason=reason,
        gate=gate,
    )
    return rollout


def _open_step_window(rollout: Rollout, metrics: RolloutMetricsSource | None) -> None:
    rollout.step_started_at = timezone.now()
    rollout.canary_mark = (metrics or default_metrics_source()).mark(rollout.canary_id)


def _finish(
    rollout: Rollout,
    state: str,
    *,
    canary_weight: int,
    actor: Any,
    reason: str,
    gate: Mapping[str, Any] | None,
) -> Rollout:
    from_state, from_weight = rollout.state, rollout.canary.traffic_weight
    rollout.state = state
    rollout.finished_at = timezone.now()
    rollout.save(update_fields=["state", "finished_at"])
    _set_weights(rollout, canary_weight)
    # The side that lost all traffic drains: its replicas finish what they hold, then stop.
    loser = rollout.baseline if canary_weight == 100 else rollout.canary
    loser.status = Deployment.Status.DRAINING
    loser.save(update_fields=["status", "updated_at"])
    _record(
        rollout,
        from_state=from_state,
        from_weight=from_weight,
        actor=actor,
        reason=reason,
        gate=gate,
    )
    return rollout


@transaction.atomic
def do_promote_rollout(
    rollout: Rollout,
    *,
    actor: Any,
    reason: str = "",
    gate: Mapping[str, Any] | None = None,
    metrics: RolloutMetricsSource | None = None,
) -> Rollout:
    """All traffic to the canary, and the baseline drains. Only onto a canary that serves
    (a ready replica) with a passing gate verdict on its current step, so the baseline never
    drains before the replicas that take over its traffic are in the routing table."""
    _require_staff_or_controller(actor)
    rollout = _locked(rollout)
    _require_state(rollout, Rollout.State.RUNNING, Rollout.State.PAUSED)
    _require_serving_and_judged(rollout, metrics)
    return _finish(
        rollout,
        Rollout.State.PROMOTED,
        canary_weight=100,
        actor=actor,
        reason=reason or "promoted by staff",
        gate=gate,
    )


@transaction.atomic
def do_rollback_rollout(
    rollout: Rollout, *, actor: Any, reason: str, gate: Mapping[str, Any] | None = None
) -> Rollout:
    _require_staff_or_controller(actor)
    rollout = _locked(rollout)
    _require_state(rollout, Rollout.State.RUNNING, Rollout.State.PAUSED)
    return _finish(
        rollout, Rollout.State.ROLLED_BACK, canary_weight=0, actor=actor, reason=reason, gate=gate
    )


@transaction.atomic
def do_abort_rollout(rollout: Rollout, *, actor: Any, reason: str = "") -> Rollout:
    require_staff(actor)
    rollout = _locked(rollout)
    _require_state(rollout, Rollout.State.RUNNING, Rollout.State.PAUSED)
    return _finish(
        rollout,
        Rollout.State.ABORTED,
        canary_weight=0,
        actor=actor,
        reason=reason or "aborted by staff",
        gate=None,
    )


@transaction.atomic
def do_pause_rollout(rollout: Rollout, *, actor: Any, reason: str = "") -> Rollout:
    """Hold the weights where they are. A failing gate still rolls back while paused."""
    require_staff(actor)
    rollout = _locked(rollout)
    _require_state(rollout, Rollout.State.RUNNING)
    rollout.state = Rollout.State.PAUSED
    rollout.save(update_fields=["state"])
    weight = rollout.canary.traffic_weight
    _record(
        rollout,
        from_state=Rollout.State.RUNNING,
        from_weight=weight,
        actor=actor,
        reason=reason or "paused by staff",
        gate=None,
    )
    return rollout


@transaction.atomic
def do_resume_rollout(
    rollout: Rollout,
    *,
    actor: Any,
    reason: str = "",
    metrics: RolloutMetricsSource | None = None,
) -> Rollout:
    """Resume with a fresh window for the current step: the pause does not count towards it."""
    require_staff(actor)
    rollout = _locked(rollout)
    _require_state(rollout, Rollout.State.PAUSED)
    rollout.state = Rollout.State.RUNNING
    _open_step_window(rollout, metrics)
    rollout.save(update_fields=["state", "step_started_at", "canary_mark"])
    weight = rollout.canary.traffic_weight
    _record(
        rollout,
        from_state=Rollout.State.PAUSED,
        from_weight=weight,
        actor=actor,
        reason=reason or "resumed by staff",
        gate=None,
    )
    return rollout


def observe_canary(rollout: Rollout) -> CanaryReplicas:
    """The canary's replicas now, read through the fleet's reverse relation (the registry
    never imports serving; the states are serving's Replica.State values). Ready means what
    the routing table admits: state ready, on a ready node, with a port."""
    replicas = rollout.canary.replicas
    ready = replicas.filter(state="ready", node__health="ready", port__isnull=False).count()
    starting = replicas.filter(state__in=("pending", "starting")).count()
    failed = replicas.filter(state="failed").order_by("-updated_at")
    last_error = failed.values_list("last_error", flat=True).first() or ""
    return CanaryReplicas(
        ready=ready,
        starting=starting,
        failed=failed.count(),
        last_error=last_error,
        placement_failure=rollout.canary_placement_failure,
    )


def _require_serving_and_judged(rollout: Rollout, metrics: RolloutMetricsSource | None) -> None:
    """A step or a promotion takes a canary that serves and a passing verdict on this step,
    both read now (not the controller's last note)."""
    state, reason = canary_condition(observe_canary(rollout))
    thresholds = GateThresholds.from_dict(rollout.gate_thresholds)
    source = metrics or default_metrics_source()
    verdict = evaluate_gates(
        source.window_stats(rollout.canary_id, rollout.canary_mark),
        source.window_stats(rollout.baseline_id, rollout.baseline_mark),
        thresholds,
    )
    refusal = promotion_refusal(state, reason, verdict, thresholds)
    if refusal is not None:
        raise ValidationError(refusal)


def do_note_canary_state(rollout: Rollout, state: CanaryState, reason: str) -> None:
    """The controller's reading of the canary's replicas; `canary_since` moves only when the
    state does."""
    changes: dict[str, Any] = {"canary_reason": reason}
    if state != rollout.canary_state or rollout.canary_since is None:
        changes |= {"canary_state": state.value, "canary_since": timezone.now()}
    if all(getattr(rollout, name) == value for name, value in changes.items()):
        return
    Rollout.objects.filter(pk=rollout.pk).update(**changes)
    for name, value in changes.items():
        setattr(rollout, name, value)


@transaction.atomic
def do_hold_rollout(rollout: Rollout, *, reason: str) -> Rollout:
    """The controller's hold of a canary that has no ready replica: its weight to 0 %, all
    traffic to the baseline (which stays active), the step and the state kept."""
    rollout = _locked(rollout)
    _require_state(rollout, *Rollout.LIVE_STATES)
    from_weight = rollout.canary.traffic_weight
    if from_weight == 0:
        return rollout
    _set_weights(rollout, 0)
    _record(
        rollout,
        from_state=rollout.state,
        from_weight=from_weight,
        actor=None,
        reason=f"held at 0 %: {reason}",
        gate=None,
    )
    return rollout


@transaction.atomic
def do_release_rollout(
    rollout: Rollout, *, reason: str, metrics: RolloutMetricsSource | None = None
) -> Rollout:
    """The controller's release of a held canary that now serves: the current step's weight,
    with a fresh window for the step (the time held does not count towards it)."""
    rollout = _locked(rollout)
    _require_state(rollout, Rollout.State.RUNNING)
    if rollout.canary.traffic_weight != 0:
        return rollout
    _open_step_window(rollout, metrics)
    rollout.save(update_fields=["step_started_at", "canary_mark"])
    _set_weights(rollout, rollout.canary_weight)
    _record(
        rollout,
        from_state=rollout.state,
        from_weight=0,
        actor=None,
        reason=f"canary serving ({reason}): step {rollout.canary_weight} %",
        gate=None,
    )
    return rollout


def do_note_canary_placement(failures: Mapping[int, str], unchanged: Collection[int] = ()) -> None:
    """The fleet's reconcile: why it could not place a replica, by deployment id (absent:
    placed what was asked). Kept on every deployment, pending capacity since it first failed
    (a changed reason keeps the since), and on the live rollouts whose canary it is, for the
    controller to hold and say why. The UPDATEs touch only the rows whose note changes. The
    deployments in `unchanged` (the pass failed on them) keep their notes as they were."""
    kept = [*failures, *unchanged]
    live = Rollout.objects.filter(state__in=Rollout.LIVE_STATES)
    live.exclude(canary_placement_failure="").exclude(canary_id__in=kept).update(
        canary_placement_failure=""
    )
    Deployment.objects.exclude(placement_failure="").exclude(pk__in=kept).update(
        placement_failure="", placement_failure_since=None
    )
    now = timezone.now()
    failing = Deployment.objects.filter(pk__in=list(failures)).select_related(
        "model_version__model", "pool__gpu_class", "decode_pool__gpu_class"
    )
    for deployment in failing:
        live.filter(canary_id=deployment.pk).exclude(
            canary_placement_failure=failures[deployment.pk]
        ).update(canary_placement_failure=failures[deployment.pk])
        failure = _fleet_reason(deployment, failures[deployment.pk])
        waiting = Deployment.objects.filter(pk=deployment.pk).exclude(placement_failure=failure)
        waiting.filter(placement_failure_since__isnull=True).update(
            placement_failure=failure, placement_failure_since=now
        )
        waiting.filter(placement_failure_since__isnull=False).update(placement_failure=failure)


def _fleet_reason(deployment: Deployment, reported: str) -> str:
    """Why the replicas a deployment lacks have no room, in the words of the placement check
    (the pool, the node with the most free GPUs); the reconcile's own words where the two
    disagree (a GPU class without datasheet figures, a node that changed in between)."""
    capacity = check_deployment_capacity(deployment, missing_only=True)
    return reported if capacity.ok else capacity.message


def do_record_rollout_decision(
    rollout: Rollout, *, move: str, reason: str, gate: Mapping[str, Any]
) -> None:
    """The controller's note of its last tick on a rollout, whatever it decided (a hold
    included): what the console and the API show as `last_decision`."""
    Rollout.objects.filter(pk=rollout.pk).update(
        last_tick_at=timezone.now(),
        last_decision={"move": move, "reason": reason, "gate": dict(gate)},
    )
