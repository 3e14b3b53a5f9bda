"""Which models and adapters each tenant may call, held in memory from Redis.

The registry publishes the Redis hash `{registry:visibility}` (registry.actions.publish_visibility)
whenever a model, adapter or grant changes: served name -> JSON
`{"kind": "model"|"adapter", "base_model", "public", "tenants": [ids], "max_context", "created"}`.
An adapter is called by its own name as the request's `model`, as with vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

from serving.redis_contracts import VISIBILITY_HASH
from tenants.keys import KeyPrincipal

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Catalog:
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)
    loaded: bool = False

    @staticmethod
    def _visible(entry: dict[str, Any], tenant_id: int) -> bool:
        return bool(entry.get("public")) or tenant_id in entry.get("tenants", ())

    def resolve(self, name: str, principal: KeyPrincipal) -> tuple[str, str | None] | None:
        """(base model, adapter or None) if the tenant may call `name`, else None."""
        tenant_id = principal.tenant_id
        entry = self.models.get(name)
        if entry is not None:
            return (name, None) if self._visible(entry, tenant_id) else None
        adapter = self.adapters.get(name)
        if adapter is None or not self._visible(adapter, tenant_id):
            return None
        base = self.models.get(adapter["base_model"])
        if base is None or not self._visible(base, tenant_id):
            return None
        return (str(adapter["base_model"]), name)

    def listing(self, principal: KeyPrincipal, servable: set[str]) -> list[dict[str, Any]]:
        """The OpenAI `/v1/models` data the key may use: visible, allowed, and deployed
        (`servable` names the models the routing table has a route for)."""
        items: list[dict[str, Any]] = []
        for name, entry in sorted(self.models.items()):
            if name not in servable:
                continue
            if self.resolve(name, principal) and principal.may_use_model(name):
                items.append(
                    {
                        "id": name,
                        "object": "model",
                        "created": int(entry.get("created", 0)),
                        "owned_by": "platform",
                        "max_model_len": entry.get("max_context"),
                    }
                )
        for name, entry in sorted(self.adapters.items()):
            if entry["base_model"] not in servable:
                continue
            if self.resolve(name, principal) and (
                principal.may_use_model(name) or principal.may_use_model(entry["base_model"])
            ):
                items.append(
                    {
                        "id": name,
                        "object": "model",
                        "created": int(entry.get("created", 0)),
                        "owned_by": "platform",
                        "parent": entry["base_model"],
                    }
                )
        return items


async def load_catalog(redis: aioredis.Redis | aioredis.RedisCluster) -> Catalog:
    rows = await redis.hgetall(VISIBILITY_HASH)
    catalog = Catalog(loaded=True)
    for raw_name, raw in rows.items():
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        entry = orjson.loads(raw)
        entry["tenants"] = frozenset(int(t) for t in entry.get("tenants", ()))
        if entry.get("kind") == "adapter":
            catalog.adapters[name] = entry
        else:
            catalog.models[name] = entry
    return catalog
