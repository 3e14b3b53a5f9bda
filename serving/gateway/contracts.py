"""What one generation (`serving.gateway.pipeline.Exchange`) needs from the process's gateway.

`serving.gateway.service.Gateway` satisfies `ExchangeServices` structurally: the pipeline
depends on this Protocol, never on the service module, and values cross between them (the
principal, the admission, the routing decision, the usage event), never the exchange itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import aiohttp

from metering.usage import UsageEvent
from serving.gateway.guardrails import Guardrail
from serving.gateway.routing import ReplicaEndpoint
from serving.router import Decision, RouteRequest, SloTier
from tenants.keys import KeyPrincipal
from tenants.limiter import Admission, Reservation


class ExchangeServices(Protocol):
    # --- reference data, all in memory --------------------------------------------------------

    @property
    def default_max_tokens(self) -> int: ...

    @property
    def guardrails(self) -> Sequence[Guardrail]: ...

    @property
    def session(self) -> aiohttp.ClientSession: ...

    def resolve_model(self, name: str, principal: KeyPrincipal) -> tuple[str, str | None] | None:
        """(base model, adapter or None) if the principal's tenant may call `name`."""
        ...

    def is_deployed(self, base_model: str) -> bool: ...

    def slo_tier(self, tier: str) -> SloTier | None:
        """The tier's objectives, as the router routes for them."""
        ...

    def check_loaded(self) -> None:
        """Raise the 503 to retry while the catalog or the routing table is not read yet."""
        ...

    def endpoint(self, replica_id: str) -> ReplicaEndpoint | None: ...

    async def reread_routing_table(self) -> None:
        """Read the routing table from Redis now (kept as it is if Redis does not answer)."""
        ...

    # --- admission: one Redis call ------------------------------------------------------------

    async def admit(
        self,
        principal: KeyPrincipal,
        *,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
    ) -> Admission:
        """The admission, allowed; else the ApiError (429, or 503 without a limiter)."""
        ...

    @property
    def lease_renewal_s(self) -> float: ...

    def renew_lease_soon(self, reservation: Reservation | None) -> None: ...

    # --- routing and the replicas' in-flight counts -------------------------------------------

    def choose(self, request: RouteRequest, exclude: frozenset[str]) -> Decision: ...

    async def wait_in_queue(
        self, tier: str, request: RouteRequest, exclude: frozenset[str]
    ) -> Decision: ...

    def request_started(
        self,
        replica_id: str,
        prefill_tokens: int,
        context_tokens: int = 0,
        *,
        tpot_objective_s: float | None = None,
    ) -> None: ...

    def request_first_token(self, replica_id: str, prefill_tokens: int) -> None: ...

    def observe_ttft(self, replica_id: str, ttft_s: float, decision: Decision) -> None: ...

    def request_finished(
        self,
        replica_id: str,
        prefill_tokens: int,
        *,
        first_token_seen: bool,
        context_tokens: int = 0,
        tpot_objective_s: float | None = None,
    ) -> None: ...

    # --- circuit breakers ---------------------------------------------------------------------

    def record_success(self, replica: ReplicaEndpoint) -> None: ...

    def record_failure(self, replica: ReplicaEndpoint, kind: str) -> None: ...

    def record_not_loaded(self, replica: ReplicaEndpoint, adapter: str | None) -> None: ...

    def abandon_probe(self, replica_id: str) -> None: ...

    # --- settle: one Redis round trip ---------------------------------------------------------

    def price(
        self,
        model: str,
        adapter: str | None,
        tier: str,
        tenant_id: int,
        at: float,
        *,
        prompt_tokens: int,
        cached_prompt_tokens: int,
        completion_tokens: int,
    ) -> int:
        """The charge in micro-USD (0 without a price)."""
        ...

    async def settle(
        self,
        event: UsageEvent,
        reservation: Reservation | None,
        *,
        rollout_deployment_id: str | None,
    ) -> None:
        """Bill `event`, settle the admission's reservation and, for a request a replica
        took, count it for its deployment's rollout."""
        ...
