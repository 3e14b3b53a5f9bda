"""The Redis names the control plane and the gateways share, in one place. No Django.

Written by the control plane, read by every gateway process:
- `{routing}:table`: the routing table, one versioned JSON document
  (serving/actions/routing_table.py); `{routing}:version` and `{routing}:digest` make its
  publish compare-and-bump in one Lua script; each new version is announced on the
  `routing:updates` channel.
- `routing:telemetry`: hash replica id -> compact JSON of the replica's last scrape
  (running, waiting, KV use, loaded adapters, scraped_at).
- `platform:loop_failures`: hash "loop:kind:id" -> JSON of the error and since when, for
  each deployment, rollout or tenant a control loop fails on now (config/loops.py); the gateways count
  it into `platform_control_loop_failures` for the alert; `platform:loop_passes`, hash loop
  -> when its last pass ended, into `platform_control_loop_last_pass_timestamp_seconds`.
- `{registry:visibility}`: hash model or adapter name -> who may see it
  (registry/actions.py); `{registry:visibility}:version` counts its publishes, in the same
  MULTI as the rewrite.

On a Redis Cluster a script or a MULTI may touch only keys of one hash slot: the keys written
together share a hash tag (the part in braces), so they live on one node. Pub/sub channels
have no slot (a PUBLISH reaches every node). The names changed from `routing:table`,
`routing:version`, `routing:digest`, `registry:visibility` and `registry:visibility:version`
when Cluster came: the control plane republishes both within a minute of an upgrade, and the
routing table's version starts again at 1 (gateways compare versions for equality only).

Each app keeps the names only it writes and its readers import from it: API key records
(`tenants/keys.py`), the usage stream (`metering/usage.py`), the price book
(`metering/pricing.py`), the latest scrapes (`serving/telemetry.py`).
"""

ROUTING_TABLE_KEY = "{routing}:table"
ROUTING_VERSION_KEY = "{routing}:version"
ROUTING_DIGEST_KEY = "{routing}:digest"
ROUTING_UPDATES_CHANNEL = "routing:updates"
ROUTING_TELEMETRY_KEY = "routing:telemetry"

VISIBILITY_HASH = "{registry:visibility}"
VISIBILITY_VERSION_KEY = "{registry:visibility}:version"

LOOP_FAILURES_KEY = "platform:loop_failures"
# Hash loop -> when its last pass ended (epoch seconds), for the ControlLoopStalled alert.
LOOP_PASSES_KEY = "platform:loop_passes"
# The loops that record there (each reported, at 0 while it fails on nothing).
CONTROL_LOOPS = ("reconcile", "routing_table", "autoscale", "rollout_tick", "invoices", "budgets")


def text(value: bytes | str) -> str:
    """A Redis reply's field or value as text (the clients return bytes)."""
    return value.decode() if isinstance(value, bytes) else value
