"""Fleet credentials: join tokens, node tokens and engine keys.

- Join tokens and node tokens are stored as SHA-256 hashes only. A join token belongs to one
  pool, expires (JOIN_TOKEN_TTL unless told otherwise) and may be single-use.
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
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from serving.models import GpuPool, JoinToken, Node

# --- tokens -------------------------------------------------------------------------------


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# A join token outlives the install it was made for by a day at most, unless told otherwise.
JOIN_TOKEN_TTL = timedelta(hours=24)


def do_create_join_token(
    pool: GpuPool,
    name: str = "",
    ttl: timedelta | None = JOIN_TOKEN_TTL,
    single_use: bool = False,
    secret: str | None = None,
) -> tuple[JoinToken, str]:
    """A new join token for `pool`, valid for `ttl` (None: until revoked) and, when
    `single_use`, for one successful registration. The secret is returned once and only its
    hash is kept."""
    if ttl is not None and ttl <= timedelta(0):
        raise ValueError("a join token's lifetime must be positive")
    secret = secret or "jt_" + secrets.token_urlsafe(32)
    token = JoinToken.objects.create(
        pool=pool,
        name=name,
        token_hash=hash_token(secret),
        expires_at=timezone.now() + ttl if ttl is not None else None,
        single_use=single_use,
    )
    return token, secret


def do_revoke_join_token(token: JoinToken) -> JoinToken:
    """No registration succeeds with it from now on; nodes it admitted keep their tokens."""
    JoinToken.objects.filter(pk=token.pk).update(revoked=True)
    token.revoked = True
    return token


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
