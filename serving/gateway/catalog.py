"""Which models and adapters each tenant may call, held in memory from Redis.

The registry publishes one document under `registry:catalog` whenever a model, version,
adapter or grant changes:

    {"models":   {"<name>": {"public": bool, "tenants": [tenant ids], "max_context": int,
                             "created": epoch seconds}},
     "adapters": {"<name>": {"base": "<model name>", "public": bool, "tenants": [ids],
                             "created": epoch seconds}}}

An adapter is called by its own name as the request's `model`, as with vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

log = logging.getLogger(__name__)

CATALOG_KEY = "registry:catalog"


@dataclass(slots=True)
class Catalog:
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)
    loaded: bool = False

    @staticmethod
    def _visible(entry: dict[str, Any], tenant_id: int) -> bool:
        return bool(entry.get("public")) or tenant_id in entry.get("tenants", ())

    def resolve(self, name: str, principal: Any) -> tuple[str, str | None] | None:
        """(base model, adapter or None) if the tenant may call `name`, else None."""
        tenant_id = principal.tenant_id
        entry = self.models.get(name)
        if entry is not None:
            return (name, None) if self._visible(entry, tenant_id) else None
        adapter = self.adapters.get(name)
        if adapter is None or not self._visible(adapter, tenant_id):
            return None
        base = self.models.get(adapter["base"])
        if base is None or not self._visible(base, tenant_id):
            return None
        return (str(adapter["base"]), name)

    def listing(self, principal: Any) -> list[dict[str, Any]]:
        """The OpenAI `/v1/models` data the key may use."""
        items: list[dict[str, Any]] = []
        for name, entry in sorted(self.models.items()):
            if self.resolve(name, principal) and principal.may_use_model(name):
                items.append(
                    {"id": name, "object": "model", "created": int(entry.get("created", 0)),
                     "owned_by": "platform", "max_model_len": entry.get("max_context")}
                )  # fmt: skip
        for name, entry in sorted(self.adapters.items()):
            if self.resolve(name, principal) and (
                principal.may_use_model(name) or principal.may_use_model(entry["base"])
            ):
                items.append(
                    {"id": name, "object": "model", "created": int(entry.get("created", 0)),
                     "owned_by": "platform", "parent": entry["base"]}
                )  # fmt: skip
        return items


async def load_catalog(redis: aioredis.Redis) -> Catalog:
    raw = await redis.get(CATALOG_KEY)
    if not raw:
        return Catalog(loaded=True)
    document = orjson.loads(raw)
    models = document.get("models") or {}
    adapters = document.get("adapters") or {}
    for entry in (*models.values(), *adapters.values()):
        entry["tenants"] = frozenset(int(t) for t in entry.get("tenants", ()))
    return Catalog(models=models, adapters=adapters, loaded=True)
