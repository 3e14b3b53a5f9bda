"""The agent's side of the control-plane contract: register with the join token, then
heartbeat with the node token. Credentials persist in the state directory so a restarted agent
is the same node."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

REGISTER_PATH = "/api/agent/v1/register"
HEARTBEAT_PATH = "/api/agent/v1/heartbeat"
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0


class Unauthorized(Exception):
    """The control plane no longer knows this node token: register again."""


class Unreachable(Exception):
    """No answer, or an answer that is not the contract's: try again next beat."""


@dataclass(frozen=True, slots=True)
class NodeCredentials:
    node_id: str
    node_token: str
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S


class CredentialStore:
    def __init__(self, state_dir: Path, control_plane: str) -> None:
        self.path = state_dir / "node.json"
        self._control_plane = control_plane

    def load(self) -> NodeCredentials | None:
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        # Credentials from another control plane would only earn a 401 there.
        if saved.get("control_plane") != self._control_plane:
            return None
        return NodeCredentials(
            node_id=str(saved["node_id"]),
            node_token=str(saved["node_token"]),
            heartbeat_interval_s=float(
                saved.get("heartbeat_interval_s", DEFAULT_HEARTBEAT_INTERVAL_S)
            ),
        )

    def save(self, credentials: NodeCredentials) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        # The node token is a secret: readable by the agent's user only, replaced atomically.
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(
                {
                    "control_plane": self._control_plane,
                    "node_id": credentials.node_id,
                    "node_token": credentials.node_token,
                    "heartbeat_interval_s": credentials.heartbeat_interval_s,
                },
                f,
            )
        os.replace(temporary, self.path)

    def forget(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class ControlPlaneClient:
    def __init__(self, base_url: str, http: aiohttp.ClientSession, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def register(self, body: dict[str, Any]) -> NodeCredentials:
        payload = await self._post(REGISTER_PATH, body, headers={})
        try:
            return NodeCredentials(
                node_id=str(payload["node_id"]),
                node_token=str(payload["node_token"]),
                heartbeat_interval_s=float(
                    payload.get("heartbeat_interval_s") or DEFAULT_HEARTBEAT_INTERVAL_S
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise Unreachable(f"register answered without node_id/node_token: {exc}") from exc

    async def heartbeat(self, node_token: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._post(
            HEARTBEAT_PATH, body, headers={"Authorization": f"Bearer {node_token}"}
        )

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        try:
            async with self._http.post(
                f"{self.base_url}{path}", json=body, headers=headers, timeout=self._timeout
            ) as response:
                if response.status == 401:
                    raise Unauthorized(await response.text())
                if response.status != 200:
                    text = await response.text()
                    raise Unreachable(f"{path}: HTTP {response.status} {text[:300]}")
                payload = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise Unreachable(f"{path}: {exc!r}") from exc
        if not isinstance(payload, dict):
            raise Unreachable(f"{path}: answer is not a JSON object")
        return payload
