"""The link a prefill replica hands a prompt's KV cache to a decode replica over.

A transfer of n bytes takes `latency_s + n / bandwidth` (prompt tokens x KV bytes per token
from the model spec). Figures are datasheet line rates each way (data/links.csv, with
sources); real transfers reach somewhat less, so the model is on the optimistic side for
disaggregation.

Contention is modelled per port, first come first served: each replica has one port (its
NIC, or its NVLink share) that is busy for `n / bandwidth` of every transfer it sends or
receives; a transfer starts when both its sender's and its receiver's ports are free and
lands `latency_s` after its last byte left. Serialising instead of sharing the bandwidth
fairly gives the same finish time for the last of a burst and earlier ones for the others,
which is what a scheduler that sends whole requests in order achieves; it keeps the event
loop free of rate recomputation. Between two replicas on different links, the slower end
sets the pace (`between`).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache

from serving.engine.specs import DATA_DIR

GB = 1e9


@dataclass(frozen=True, slots=True)
class LinkSpec:
    name: str
    # Decimal GB per second, each direction.
    gbytes_per_s: float
    latency_s: float
    source: str = ""

    def serialisation_s(self, nbytes: float) -> float:
        """How long the bytes occupy a port."""
        return nbytes / (self.gbytes_per_s * GB)

    def transfer_s(self, nbytes: float) -> float:
        """From the first byte sent to the last byte landed, on an idle link."""
        return self.latency_s + self.serialisation_s(nbytes)


def between(sender: LinkSpec, receiver: LinkSpec) -> LinkSpec:
    """The path between two ends: the lower bandwidth and the higher latency."""
    if sender == receiver:
        return sender
    return LinkSpec(
        f"{sender.name}->{receiver.name}",
        min(sender.gbytes_per_s, receiver.gbytes_per_s),
        max(sender.latency_s, receiver.latency_s),
    )


def kv_transfer_s(prompt_tokens: int, kv_bytes_per_token: float, link: LinkSpec) -> float:
    """A prompt's KV over an idle link."""
    return link.transfer_s(prompt_tokens * kv_bytes_per_token)


class LinkPort:
    """One replica's end of the KV link: when it is next free to send or receive."""

    __slots__ = ("free_s", "spec")

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.free_s = 0.0


def schedule_transfer(
    ready_s: float, nbytes: float, sender: LinkPort, receiver: LinkPort
) -> tuple[float, float]:
    """(start, landed) of a transfer whose bytes are ready at `ready_s`; both ports are
    booked for its serialisation time."""
    link = between(sender.spec, receiver.spec)
    start = max(ready_s, sender.free_s, receiver.free_s)
    sent = start + link.serialisation_s(nbytes)
    sender.free_s = receiver.free_s = sent
    return start, sent + link.latency_s


@cache
def load_link_specs() -> dict[str, LinkSpec]:
    with (DATA_DIR / "links.csv").open(newline="") as f:
        return {
            row["link"]: LinkSpec(
                name=row["link"],
                gbytes_per_s=float(row["gbytes_per_s"]),
                latency_s=float(row["latency_us"]) * 1e-6,
                source=row["source"],
            )
            for row in csv.DictReader(f)
        }
