"""The Redis names the control plane and the gateways share, in one place. No Django.

Written by the control plane, read by every gateway process:
- `routing:table`: the routing table, one versioned JSON document
  (serving/actions/routing_table.py); `routing:version` and `routing:digest` make its publish
  compare-and-bump; each new version is announced on the `routing:updates` channel.
- `routing:telemetry`: hash replica id -> compact JSON of the replica's last scrape
  (running, waiting, KV use, loaded adapters, scraped_at).
- `registry:visibility`: hash model or adapter name -> who may see it
  (registry/actions.py); `registry:visibility:version` counts its publishes.

Each app keeps the names only it writes and its readers import from it: API key records
(`tenants/keys.py`), the usage stream (`metering/usage.py`), the price book
(`metering/pricing.py`), the latest scrapes (`serving/telemetry.py`).
"""

ROUTING_TABLE_KEY = "routing:table"
ROUTING_VERSION_KEY = "routing:version"
ROUTING_DIGEST_KEY = "routing:digest"
ROUTING_UPDATES_CHANNEL = "routing:updates"
ROUTING_TELEMETRY_KEY = "routing:telemetry"

VISIBILITY_HASH = "registry:visibility"
VISIBILITY_VERSION_KEY = "registry:visibility:version"
