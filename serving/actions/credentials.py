"""Fleet credentials: join tokens, node tokens and engine keys.

- Join tokens and node tokens are stored as SHA-256 hashes only.
- The control plane also calls the agent (PUT /v1/replicas) with the node token. Rather than
  keep the token in the database, a node token is HMAC-SHA256(SECRET_KEY, node id + a random
  nonce stored on the node): the control plane rebuilds it when it needs it, and a copy of the
  database without the secret key reveals nothing. Re-registering draws a new nonce, which
  revokes the old token.
- An engine key is HMAC-SHA256(SECRET_KEY, replica id): never stored either.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime
from typing import Any

from django.conf import settings

from serving.models import GpuPool, JoinToken, Node

# --- tokens -------------------------------------------------------------------------------


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def do_create_join_token(
    pool: GpuPool,
    name: str = "",
    expires_at: datetime | None = None,
    secret: str | None = None,
) -> tuple[JoinToken, str]:
    """A new join token for `pool`; the secret is returned once and only its hash is kept."""
    secret = secret or "jt_" + secrets.token_urlsafe(32)
    token = JoinToken.objects.create(
        pool=pool, name=name, token_hash=hash_token(secret), expires_at=expires_at
    )
    return token, secret


def node_token(node: Node) -> str:
    """The node's bearer token, rebuilt from the secret key and the node's nonce."""
    message = f"{node.pk}:{node.token_nonce}".encode()
    digest = hmac.new(settings.SECRET_KEY.encode(), message, hashlib.sha256).hexdigest()
    return "nt_" + digest


def engine_api_key(replica_id: int | str) -> str:
    """The replica's engine key (vLLM's --api-key), rebuilt from the secret key: the agent
    launches the engine with it, the gateways send it, and a caller without it is refused by
    the engine itself. Nothing stores it in PostgreSQL."""
    message = f"engine:{replica_id}".encode()
    return "ek_" + hmac.new(settings.SECRET_KEY.encode(), message, hashlib.sha256).hexdigest()


def authenticate_node(node_id: Any, bearer: str) -> Node | None:
    """The node this bearer token belongs to, or None (the caller answers 401)."""
    try:
        node = Node.objects.select_related("pool").get(pk=int(node_id))
    except (Node.DoesNotExist, TypeError, ValueError):
        return None
    if not node.token_hash or not hmac.compare_digest(node.token_hash, hash_token(bearer)):
        return None
    return node


# --- registration -------------------------------------------------------------------------
