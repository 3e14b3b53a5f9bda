"""Disaggregated requests in metering: the prefill replica travels with the usage event into
PostgreSQL, and cost to serve charges the request on both of its replicas."""

from __future__ import annotations

import orjson
import pytest
import redis

from metering import ingest
from metering.cost import ReplicaWindow, ServedRequest, gpu_time_usd_micros, split
from metering.cost import weights_for_window as weights_for
from metering.models import ReplicaHour, UsageEvent
from metering.prices import usd_to_micros
from metering.rollups import attribute_hour
from metering.usage import EVENT_FIELD, USAGE_STREAM
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs
from tenants.models import Tenant
from tests.metering.helpers import event
from tests.metering.test_ingest import acme, write  # noqa: F401 (acme: fixture)
from tests.metering.test_ledger import (  # noqa: F401 (fleet: fixture)
    HOUR,
    LATER,
    Fleet,
    at,
    fleet,
    make_replica,
    store,
)


def test_the_prefill_replica_of_an_event_is_ingested_with_it(
    acme: Tenant,  # noqa: F811
    redis_client: redis.Redis,
) -> None:
    disaggregated = event(acme.pk, prefill_replica_id="p-7", prefill_pool="h100-prefill")
    write(redis_client, [disaggregated])
    ingest.Consumer(redis_client, "c1").drain(max_seconds=10)
    row = UsageEvent.objects.get(pk=disaggregated.request_id)
    assert (row.prefill_replica_id, row.prefill_pool) == ("p-7", "h100-prefill")
    assert (row.replica_id, row.pool) == (disaggregated.replica_id, disaggregated.pool)


def test_an_event_from_a_gateway_that_knows_no_prefill_replica_ingests_with_none(
    acme: Tenant,  # noqa: F811
    redis_client: redis.Redis,
) -> None:
    older = orjson.loads(event(acme.pk).to_json())
    del older["prefill_replica_id"], older["prefill_pool"]
    redis_client.xadd(USAGE_STREAM, {EVENT_FIELD: orjson.dumps(older)})
    result = ingest.Consumer(redis_client, "c1").drain(max_seconds=10)
    assert (result.inserted, result.dead) == (1, 0)
    row = UsageEvent.objects.get(pk=older["request_id"])
    assert (row.prefill_replica_id, row.prefill_pool) == ("", "")


def test_a_disaggregated_request_pays_for_its_prefill_on_one_replica_and_its_decode_on_the_other(
    fleet: Fleet,  # noqa: F811
) -> None:
    prefill = make_replica(fleet, 0, 1, [(at(0), "ready")])
    decode = make_replica(fleet, 1, 1, [(at(0), "ready")])
    split_request = store(decode, at(10))
    UsageEvent.objects.filter(pk=split_request).update(
        prefill_replica_id=prefill.replica_id, prefill_pool=prefill.deployment.pool.name
    )
    ordinary = store(decode, at(11))
    # The same work for both, so on the decode replica only the prompt's prefill tells them apart.
    UsageEvent.objects.filter(pk__in=[split_request, ordinary]).update(
        prompt_tokens=2000, completion_tokens=40
    )

    assert attribute_hour(HOUR, LATER) == 2

    rows = {r.replica_id: r for r in ReplicaHour.objects.filter(hour=HOUR)}
    on_prefill, on_decode = rows[prefill.replica_id], rows[decode.replica_id]
    assert (on_prefill.requests, on_decode.requests) == (1, 2)
    hour_us = 3600 * 1_000_000
    assert on_prefill.cost_usd_micros == gpu_time_usd_micros(hour_us, usd_to_micros("3.49"))
    assert on_decode.cost_usd_micros == gpu_time_usd_micros(hour_us, usd_to_micros("0.71"))

    # Its share on the prefill replica, the only request there: its uncached prompt's prefill.
    h100 = PerfModel(load_gpu_specs()["H100-SXM-80GB"], load_model_specs()["llama-3.1-8b"])
    window = ReplicaWindow(prefill.replica_id, hour_us, 1, usd_to_micros("3.49"))
    prefill_work = [ServedRequest(split_request, 2000, 0, 0, 0.0)]
    [prefill_share] = split(window, prefill_work, weights_for(h100, window, prefill_work)).requests
    assert prefill_share.cost_usd_micros > 0
    assert prefill_share.cost_usd_micros + on_prefill.idle_usd_micros == on_prefill.cost_usd_micros

    charged = {e.request_id: e for e in UsageEvent.objects.filter(pk__in=[split_request, ordinary])}
    decode_share = charged[split_request].cost_to_serve_usd_micros - prefill_share.cost_usd_micros
    assert (
        decode_share + charged[ordinary].cost_to_serve_usd_micros + on_decode.idle_usd_micros
        == on_decode.cost_usd_micros
    )
    # Its prompt reached the decode replica as KV cache: there it pays for less than the
    # ordinary request, which prefilled the same prompt itself.
    assert 0 < decode_share < charged[ordinary].cost_to_serve_usd_micros

    decode_busy_s = on_decode.gpu_seconds - on_decode.idle_gpu_seconds
    decode_alone_s = decode_busy_s - charged[ordinary].gpu_seconds
    assert charged[split_request].gpu_seconds > decode_alone_s
    assert charged[split_request].gpu_seconds == pytest.approx(
        decode_alone_s + prefill_share.gpu_seconds, rel=1e-9
    )
