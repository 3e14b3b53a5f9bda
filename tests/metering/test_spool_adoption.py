"""Spools left by gateway processes that exited are adopted, replayed and billed once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings

from metering import ingest, usage
from metering.models import UsageEvent
from metering.usage import USAGE_STREAM, UsageSpool
from tenants.models import Tenant
from tests.metering.helpers import event

ROOT = Path(__file__).resolve().parents[2]

# A gateway process in miniature: settles `count` events while Redis is unreachable, so each
# goes to its own spool, prints their request ids, then ends the way `how` says.
SPOOLING_PROCESS = """
import json, os, sys, uuid
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from metering.usage import UsageSpool, add_usage_event
from tests.metering.helpers import event

directory, tenant_id, count, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spool = UsageSpool(os.path.join(directory, f"usage-spool-{os.getpid()}.jsonl"))
unreachable = redis.Redis(
    host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
)
ids = []
for _ in range(count):
    settled = event(tenant_id, request_id=f"req-{uuid.uuid4().hex}")
    pipe = unreachable.pipeline(transaction=False)
    add_usage_event(pipe, settled)
    try:
        pipe.execute()
    except redis.ConnectionError:
        spool.append(settled)
        ids.append(settled.request_id)
print(json.dumps(ids), flush=True)
if how == "torn":
    with open(spool.path, "ab") as f:
        f.write(b'{"request_id": "req-torn", "tenant_')  # killed mid-append
    os._exit(1)
if how == "hold":
    sys.stdin.read()  # alive, holding its lock, until the test closes stdin
"""

# Another gateway process's periodic check: waits for the go file so two start together.
ADOPTING_PROCESS = """
import asyncio, os, sys, time
import redis.asyncio as aioredis
from metering.usage import UsageSpool

directory, redis_url, go = sys.argv[1], sys.argv[2], sys.argv[3]

async def main():
    client = aioredis.Redis.from_url(redis_url)
    spool = UsageSpool(os.path.join(directory, f"usage-spool-{os.getpid()}.jsonl"))
    while not os.path.exists(go):
        time.sleep(0.001)
    print(await spool.adopt_orphans(client), flush=True)
    await client.aclose()

asyncio.run(main())
"""


@pytest.fixture
def acme(db: None) -> Tenant:
    return Tenant.objects.create(slug="acme", name="Acme")


def spool_and_exit(directory: Path, tenant: Tenant, count: int, how: str = "exit") -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SPOOLING_PROCESS, str(directory), str(tenant.pk), str(count), how],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == (1 if how == "torn" else 0), done.stderr.decode()
    ids: list[str] = json.loads(done.stdout)
    assert len(ids) == count
    return ids


def adopt(directory: Path) -> int:
    async def run() -> int:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            return await UsageSpool(directory / "usage-spool-adopter.jsonl").adopt_orphans(client)
        finally:
            await client.aclose()

    return asyncio.run(run())


def billed(redis_client: redis.Redis) -> list[str]:
    ingest.Consumer(redis_client, "c1").drain(max_seconds=30)
    return sorted(UsageEvent.objects.values_list("request_id", flat=True))


def spool_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_spool_left_by_an_exited_process_is_replayed_billed_once_and_removed(
    tmp_path: Path, acme: Tenant, redis_client: redis.Redis
) -> None:
    ids = spool_and_exit(tmp_path, acme, 1203)
    assert adopt(tmp_path) == 1203
    assert adopt(tmp_path) == 0  # nothing left for the next check
    assert billed(redis_client) == sorted(ids)
    assert spool_files(tmp_path) == []


def test_a_spool_whose_owner_is_alive_is_left_alone(
    tmp_path: Path, acme: Tenant, redis_client: redis.Redis
) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", SPOOLING_PROCESS, str(tmp_path), str(acme.pk), "5", "hold"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert owner.stdout is not None
        assert len(json.loads(owner.stdout.readline())) == 5
        assert adopt(tmp_path) == 0
        assert redis_client.xlen(USAGE_STREAM) == 0
        assert UsageSpool(tmp_path / f"usage-spool-{owner.pid}.jsonl").pending() == 5
    finally:
        owner.communicate(timeout=30)  # closes stdin: the owner exits


def test_a_spool_is_adopted_once_its_owner_has_exited(
    tmp_path: Path, acme: Tenant, redis_client: redis.Redis
) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", SPOOLING_PROCESS, str(tmp_path), str(acme.pk), "5", "hold"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert owner.stdout is not None
    ids = json.loads(owner.stdout.readline())
    assert adopt(tmp_path) == 0
    owner.communicate(timeout=30)
    assert adopt(tmp_path) == 5
    assert billed(redis_client) == sorted(ids)


def test_a_torn_last_line_of_a_crashed_process_is_skipped(
    tmp_path: Path, acme: Tenant, redis_client: redis.Redis
) -> None:
    ids = spool_and_exit(tmp_path, acme, 7, how="torn")
    assert adopt(tmp_path) == 7
    assert billed(redis_client) == sorted(ids)
    assert spool_files(tmp_path) == []


def test_a_spool_that_is_nothing_but_a_torn_line_is_removed(tmp_path: Path) -> None:
    (tmp_path / "usage-spool-41.jsonl").write_bytes(b'{"request_id": "req-torn", "ten')
    assert adopt(tmp_path) == 0
    assert spool_files(tmp_path) == []


def test_a_spool_from_before_ownership_locks_is_adopted(
    tmp_path: Path, acme: Tenant, redis_client: redis.Redis
) -> None:
    events = [event(acme.pk) for _ in range(3)]
    (tmp_path / "usage-spool-42.jsonl").write_bytes(b"".join(e.to_json() + b"\n" for e in events))
    assert adopt(tmp_path) == 3
    assert billed(redis_client) == sorted(e.request_id for e in events)


def test_two_processes_adopting_the_same_spool_at_once_bill_it_once(
    tmp_path: Path, acme: Tenant, redis_client: redis.Redis
) -> None:
    ids = spool_and_exit(tmp_path, acme, 1500)
    go = tmp_path / "go"
    adopters = [
        subprocess.Popen(
            [sys.executable, "-c", ADOPTING_PROCESS, str(tmp_path), settings.REDIS_URL, str(go)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    time.sleep(1.0)  # both imported and waiting
    go.touch()
    sent = []
    for adopter in adopters:
        out, err = adopter.communicate(timeout=60)
        assert adopter.returncode == 0, err.decode()
        sent.append(int(out))
    assert sorted(sent) == [0, 1500]  # the lock let one of them send it
    assert redis_client.xlen(USAGE_STREAM) == 1500
    assert billed(redis_client) == sorted(ids)


def test_an_adoption_cut_short_and_redone_bills_each_event_once(
    tmp_path: Path, acme: Tenant, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = spool_and_exit(tmp_path, acme, 1203)
    rewrite = usage._rewrite_replaying

    def crash_after_first_chunk(replaying: Path, lines: list[bytes]) -> None:
        monkeypatch.setattr(usage, "_rewrite_replaying", rewrite)
        raise OSError("killed after the chunk reached Redis, before the file was rewritten")

    monkeypatch.setattr(usage, "_rewrite_replaying", crash_after_first_chunk)
    with pytest.raises(OSError):
        adopt(tmp_path)
    assert adopt(tmp_path) == 1203  # the first chunk again, then the rest
    assert redis_client.xlen(USAGE_STREAM) == 1203 + UsageSpool.REPLAY_CHUNK
    assert billed(redis_client) == sorted(ids)
