"""The agent's own HTTP API, for the control plane to push the desired set (the heartbeat answer
pulls the same set, which also works behind NAT). Every route but /healthz wants the node token."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from .control_plane import NodeCredentials
from .specs import SpecError


class ServedAgent(Protocol):
    """What the API needs of the agent (serving/agent/agent.py's NodeAgent)."""

    credentials: NodeCredentials | None
    last_heartbeat_ok_at: float | None

    @property
    def node_token(self) -> str | None: ...

    async def apply_desired_json(self, raw: Any) -> None: ...

    def replica_states(self) -> list[dict[str, Any]]: ...


AGENT_KEY: web.AppKey[ServedAgent] = web.AppKey("agent")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def require_node_token(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path == "/healthz":
        return await handler(request)
    expected = request.app[AGENT_KEY].node_token
    presented = request.headers.get("Authorization", "")
    # Before registration there is no token, and nothing may be changed.
    if expected is None or not hmac.compare_digest(presented, f"Bearer {expected}"):
        return web.json_response(
            {"detail": "a valid node token is required"},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return await handler(request)


async def put_replicas(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"detail": "the body must be JSON"}, status=400)
    if not isinstance(body, dict) or "replicas" not in body:
        return web.json_response({"detail": "the body must be {replicas: [...]}"}, status=400)
    try:
        await agent.apply_desired_json(body["replicas"])
    except SpecError as exc:
        return web.json_response({"detail": str(exc)}, status=400)
    return web.json_response({"replicas": agent.replica_states()})


async def get_replicas(request: web.Request) -> web.Response:
    return web.json_response({"replicas": request.app[AGENT_KEY].replica_states()})


async def healthz(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    return web.json_response(
        {
            "status": "ok",
            "node_id": agent.credentials.node_id if agent.credentials else None,
            "last_heartbeat_ok_at": agent.last_heartbeat_ok_at,
        }
    )


def build_agent_app(agent: ServedAgent) -> web.Application:
    app = web.Application(middlewares=[require_node_token])
    app[AGENT_KEY] = agent
    app.router.add_put("/v1/replicas", put_replicas)
    app.router.add_get("/v1/replicas", get_replicas)
    app.router.add_get("/healthz", healthz)
    return app
