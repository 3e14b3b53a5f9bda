"""The routing table: deployments, their canary weights and their READY replicas, as one
versioned JSON document in Redis that every gateway process keeps in memory.

`publish_routing_table()` bumps the version only when the content changed (compared by digest
inside one Lua script, so two publishers never both bump), then announces the version on
`routing:updates`. Only replicas in state Ready enter: starting, draining, failed replicas and
those of a NotReady node never receive traffic.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson
from django.utils import timezone

from config.loops import LoopPass
from config.redis import redis_client
from registry.models import Deployment, Rollout
from serving.actions.credentials import engine_api_key
from serving.actions.reconcile import (
    KV_CONNECTOR_LINKS,
    Launch,
    deployment_launch,
    deployments_to_run,
    phase_launch,
)
from serving.models import Node, Replica
from serving.redis_contracts import (
    ROUTING_DIGEST_KEY,
    ROUTING_TABLE_KEY,
    ROUTING_TELEMETRY_KEY,
    ROUTING_UPDATES_CHANNEL,
    ROUTING_VERSION_KEY,
)

logger = logging.getLogger(__name__)


# Compare, bump, store and announce atomically. The document is the content with the version
# and publish time spliced in front, so the stored JSON is one self-describing object.
_PUBLISH_SCRIPT = """
if redis.call('GET', KEYS[3]) == ARGV[1] then return 0 end
local version = redis.call('INCR', KEYS[2])
local doc = '{"version":' .. version .. ',"published_at":"' .. ARGV[3] .. '",' .. string.sub(ARGV[2], 2)
redis.call('SET', KEYS[1], doc)
redis.call('SET', KEYS[3], ARGV[1])
redis.call('PUBLISH', ARGV[4], version)
return version
"""


def build_routing_table(
    last: Callable[[], dict[str, Any] | None] = lambda: None,
    this_pass: LoopPass | None = None,
) -> dict[str, Any]:
    """The table's content (without version and publish time), from PostgreSQL. An active
    deployment whose entry cannot be built (`this_pass` notes why) keeps its entry of
    `last()`, the table published before, if it had one, with its weight and role now and
    only its replicas still Ready: they go on serving what they served."""
    this_pass = this_pass or LoopPass("routing_table", "deployment")
    ready = _ready_replicas()
    rollouts = _live_rollouts()
    carried: dict[int, tuple[str, dict[str, Any]]] | None = None  # read at a first failure
    models: dict[str, dict[str, Any]] = {}
    for deployment in deployments_to_run():
        with this_pass.item(deployment.pk):
            launch = deployment_launch(deployment)
            if not launch.active:
                continue  # a draining deployment's replicas finish their work, nothing new
            entry = _deployment_entry(deployment, launch, rollouts, ready)
            _route(models, launch.served_model_name, rollouts)["deployments"].append(entry)
        if deployment.pk in this_pass.failed and deployment.status == Deployment.Status.ACTIVE:
            carried = _entries_by_deployment(last()) if carried is None else carried
            if deployment.pk in carried:
                model_name, entry = carried[deployment.pk]
                entry = _carried_entry(entry, deployment, rollouts.get(model_name), ready)
                _route(models, model_name, rollouts)["deployments"].append(entry)
    return {"models": models}


def _route(
    models: dict[str, dict[str, Any]], model_name: str, rollouts: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    rollout = rollouts.get(model_name)
    return models.setdefault(
        model_name,
        {
            "cohort_by_tenant": bool(rollout and rollout["cohort_by_tenant"]),
            "rollout": rollout,
            "deployments": [],
        },
    )


def _deployment_entry(
    deployment: Any,
    launch: Launch,
    rollouts: dict[str, dict[str, Any]],
    ready: dict[int, list[Replica]],
) -> dict[str, Any]:
    return {
        "deployment_id": deployment.pk,
        "name": deployment.name,
        "version": launch.version_label,
        "version_id": deployment.model_version_id,
        "weight": launch.traffic_weight,
        "slo_tier": launch.slo_tier,
        "role": _role(rollouts.get(launch.served_model_name), deployment.pk),
        "pool": deployment.pool.name,
        # Disaggregated: its replicas' rows say which phase each serves.
        "decode_pool": deployment.decode_pool.name if deployment.decode_pool else None,
        "adapters": [name for name, _ in launch.adapters],
        "replicas": [
            _replica_row(replica, phase_launch(deployment, replica.phase, launch))
            for replica in ready.get(deployment.pk, [])
        ],
    }


def _carried_entry(
    entry: dict[str, Any],
    deployment: Any,
    rollout: dict[str, Any] | None,
    ready: dict[int, list[Replica]],
) -> dict[str, Any]:
    """A failing deployment's last published entry, brought up to what is known without its
    launch: its weight and rollout role now, and only those of its replicas still Ready."""
    serving = {replica.replica_id for replica in ready.get(deployment.pk, [])}
    return {
        **entry,
        "weight": int(deployment.traffic_weight),
        "role": _role(rollout, deployment.pk),
        "replicas": [row for row in entry["replicas"] if row["replica_id"] in serving],
    }


def _entries_by_deployment(table: dict[str, Any] | None) -> dict[int, tuple[str, dict[str, Any]]]:
    """A published table's deployment entries, by deployment id, with their model's name."""
    if not table:
        return {}
    return {
        int(entry["deployment_id"]): (model_name, entry)
        for model_name, route in table.get("models", {}).items()
        for entry in route.get("deployments", [])
    }


def _live_rollouts() -> dict[str, dict[str, Any]]:
    return {
        rollout.model.name: {
            "rollout_id": rollout.pk,
            "baseline_deployment_id": rollout.baseline_id,
            "canary_deployment_id": rollout.canary_id,
            "cohort_by_tenant": rollout.cohort_by_tenant,
        }
        for rollout in Rollout.objects.filter(state__in=Rollout.LIVE_STATES).select_related("model")
    }


def _role(rollout: dict[str, Any] | None, deployment_id: int) -> str | None:
    if rollout is None:
        return None
    if rollout["canary_deployment_id"] == deployment_id:
        return "canary"
    return "baseline" if rollout["baseline_deployment_id"] == deployment_id else None


def _ready_replicas() -> dict[int, list[Replica]]:
    replicas = (
        Replica.objects.filter(
            state=Replica.State.READY, node__health=Node.Health.READY, port__isnull=False
        )
        .select_related("node__pool__gpu_class")
        .order_by("pk")
    )
    by_deployment: dict[int, list[Replica]] = {}
    for replica in replicas:
        by_deployment.setdefault(replica.deployment_id, []).append(replica)
    return by_deployment


def _replica_row(replica: Replica, launch: Launch) -> dict[str, Any]:
    pool = replica.node.pool
    host = urlsplit(replica.node.agent_url).hostname or replica.node.hostname
    gpus = len(replica.gpu_indices)
    return {
        "replica_id": replica.replica_id,
        "phase": replica.phase,
        "endpoint": f"http://{host}:{replica.port}",
        "api_key": engine_api_key(replica.pk),
        "node": replica.node.hostname,
        "pool": pool.name,
        "region": pool.region,
        "gpu_class": pool.gpu_class.name,
        "gpus": gpus,
        "price_per_hour": float(pool.price_per_gpu_hour * gpus),
        "spot": pool.spot,
        "tensor_parallel": launch.tensor_parallel,
        "model_spec": launch.model_spec,
        "quantization": launch.quantization,
        "max_model_len": launch.max_model_len,
        "max_num_seqs": launch.max_num_seqs,
        "max_num_batched_tokens": launch.max_num_batched_tokens,
        "kv_cache_dtype": launch.kv_cache_dtype,
        "gpu_memory_utilization": launch.gpu_memory_utilization,
        # LoRA slots: the router sends adapter requests only where adapters can be served.
        "max_loras": launch.max_loras if launch.enable_lora else 0,
        "adapters": [name for name, _ in launch.adapters],
        # A prefill or decode replica's end of the KV hand-over (colocated: none).
        "kv_link": KV_CONNECTOR_LINKS.get(launch.kv_connector) if launch.kv_connector else None,
    }


def publish_routing_table() -> int:
    """Publish the table if it changed; the new version, or 0 when nothing changed."""
    client = redis_client()
    this_pass = LoopPass("routing_table", "deployment")
    content = build_routing_table(lambda: read_routing_table(client), this_pass)
    body = orjson.dumps(content, option=orjson.OPT_SORT_KEYS)
    digest = hashlib.sha256(body).hexdigest()
    published_at = timezone.now().isoformat()
    version = int(
        client.eval(
            _PUBLISH_SCRIPT,
            3,
            ROUTING_TABLE_KEY,
            ROUTING_VERSION_KEY,
            ROUTING_DIGEST_KEY,
            digest,
            body,
            published_at,
            ROUTING_UPDATES_CHANNEL,
        )
    )
    _prune_telemetry(client)
    this_pass.record(client)
    if version:
        logger.info("routing table v%d published", version)
    return version


def _prune_telemetry(client: Any) -> None:
    """Drop routing telemetry of replicas that no longer run (a lost node's, a stopped one's)."""
    live = {
        str(pk)
        for pk in Replica.objects.filter(state__in=Replica.HOLDING_STATES).values_list(
            "pk", flat=True
        )
    }
    stale = [
        key.decode() for key in client.hkeys(ROUTING_TELEMETRY_KEY) if key.decode() not in live
    ]
    if stale:
        client.hdel(ROUTING_TELEMETRY_KEY, *stale)


def read_routing_table(client: Any | None = None) -> dict[str, Any] | None:
    raw = (client or redis_client()).get(ROUTING_TABLE_KEY)
    return None if raw is None else orjson.loads(raw)
