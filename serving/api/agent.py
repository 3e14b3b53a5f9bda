"""The node agents' API (/api/agent/v1/): registration and heartbeats.

Plain function views: token auth in the header, no session, no CSRF, a handful of queries.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from serving.actions import credentials, nodes


def _json(body: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(body), status=status, content_type="application/json")


def _error(status: int, message: str) -> HttpResponse:
    return _json({"error": message}, status=status)


def _body(request: HttpRequest) -> dict[str, Any] | None:
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


@csrf_exempt
@require_POST
def register(request: HttpRequest) -> HttpResponse:
    body = _body(request)
    if body is None:
        return _error(400, "the body must be a JSON object")
    gpus = body.get("gpus") or []
    if not isinstance(gpus, list) or not all(isinstance(g, dict) and "index" in g for g in gpus):
        return _error(400, "gpus must be a list of objects with an index")
    try:
        node, token = nodes.do_register_node(
            str(body.get("join_token") or ""),
            str(body.get("hostname") or ""),
            str(body.get("agent_url") or ""),
            gpus,
            presented_token=str(body["node_token"]) if body.get("node_token") else None,
        )
    except nodes.NodeAlreadyRegistered as refusal:
        return _error(409, str(refusal))
    except nodes.RegistrationRefused as refusal:
        return _error(401, str(refusal))
    return _json(
        {
            "node_id": node.pk,
            "node_token": token,
            "heartbeat_interval_s": nodes.HEARTBEAT_INTERVAL_S,
        }
    )


@csrf_exempt
@require_POST
def heartbeat(request: HttpRequest) -> HttpResponse:
    body = _body(request)
    if body is None:
        return _error(400, "the body must be a JSON object")
    scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
    node = (
        credentials.authenticate_node(body.get("node_id"), bearer.strip())
        if scheme.lower() == "bearer"
        else None
    )
    if node is None:
        return _error(401, "unknown node or bad node token")
    desired = nodes.do_record_heartbeat(node, body)
    return _json({"desired_replicas": desired})
