"""The overview's live feed: staff browsers join the `fleet-live` group over a WebSocket.

Session auth (Channels' AuthMiddlewareStack); anyone but staff is refused at the handshake.
The first snapshot is sent on connect, so the page never waits for the next broadcast.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from serving.console.live import FLEET_GROUP
from serving.console.queries import fleet_snapshot


class FleetLiveConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if not getattr(user, "is_staff", False) or not getattr(user, "is_active", False):
            await self.close(code=4403)
            return
        await self.channel_layer.group_add(FLEET_GROUP, self.channel_name)
        await self.accept()
        snapshot = await database_sync_to_async(fleet_snapshot)(rate=False)
        await self.send_json(snapshot)

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(FLEET_GROUP, self.channel_name)

    async def fleet_snapshot(self, event: dict[str, Any]) -> None:
        await self.send_json(event["snapshot"])
