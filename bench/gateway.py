"""Gateway overhead and throughput, side by side with LiteLLM's proxy, in one run.

Run:
    python3.11 -m venv /tmp/litellm && /tmp/litellm/bin/pip install 'litellm[proxy]'
    DEBUG=1 .venv/bin/python bench/gateway.py --litellm /tmp/litellm/bin/litellm

One engine simulator in fixed-latency mode (16-token streams, 10 ms between tokens) is the
upstream of three targets, measured one after the other at each concurrency:
  direct   the engine simulator itself (the baseline TTFT),
  ours     this platform's gateway (uvicorn, N workers) with API keys, the Redis rate limiter,
           the router, usage events written to the Redis stream at settle, and the metering
           consumer draining that stream into PostgreSQL in its own process,
  litellm  LiteLLM's proxy with the same number of workers, pointed at the same simulator,
  before   with `--baseline DIR`: this platform's gateway as checked out in DIR (another
           revision, e.g. `git worktree add /tmp/before REV`), run from the same venv,
           measured right after `ours` at each concurrency: a regression check under the
           same noise.
The load generator is one aiohttp process, closed loop: C workers each send a streamed chat
completion and send the next when it finishes. Added TTFT = a target's TTFT percentile
minus the direct TTFT percentile at the same concurrency. Uses PostgreSQL and Redis from
DATABASE_URL / REDIS_URL (a scratch database `platform_bench` and Redis DB 12 by default).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = "llama-3.1-8b"
TOKENS = 16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_http(url: str, timeout_s: float = 90) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            # The URLs are the bench's own http://127.0.0.1 servers, never a caller's.
            with urllib.request.urlopen(url, timeout=2) as reply:  # nosec B310  # own http URL
                if reply.status < 500:
                    return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"{url} did not come up")


def start(
    argv: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def start_gateway(
    port: int, workers: int, env: dict[str, str], log: Path, tree: Path = ROOT
) -> subprocess.Popen[bytes]:
    """The platform's ASGI server, as checked out in `tree`, from this venv."""
    uvicorn = str(Path(sys.executable).parent / "uvicorn")
    argv = [uvicorn, "config.asgi:application", "--port", str(port), "--workers", str(workers)]
    argv += ["--no-access-log", "--lifespan", "off", "--log-level", "warning"]
    return start(argv, env, log, cwd=tree)


def stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


# --- the platform's side ----------------------------------------------------------------------


def prepare_platform(env: dict[str, str], upstream: str) -> str:
    """Migrate the scratch database, make a tenant and key with room to spare, publish the
    routing table, visibility and price book. Returns the key's secret."""
    os.environ.update(env)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT / "scripts"))
    from services import ensure_database

    ensure_database(env["DATABASE_URL"])
    import django

    django.setup()
    from datetime import UTC, datetime, timedelta
    from decimal import Decimal

    import redis
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from metering.models import PriceSheet
    from metering.prices import publish_price_book
    from serving.redis_contracts import ROUTING_TABLE_KEY, ROUTING_TELEMETRY_KEY, VISIBILITY_HASH
    from tenants.actions import do_create_api_key, do_create_tenant, do_update_quota
    from tenants.models import Tenant

    call_command("migrate", verbosity=0)
    client = redis.Redis.from_url(env["REDIS_URL"])
    client.flushdb()
    admin, _ = get_user_model().objects.get_or_create(username="bench-admin", is_staff=True)
    tenant = Tenant.objects.filter(slug="bench").first() or do_create_tenant("bench", "Bench")
    do_update_quota(
        tenant.quota,
        requests_per_minute=10_000_000,
        tokens_per_minute=1_000_000_000,
        concurrent_streams=100_000,
        max_tokens_cap=4096,
    )
    _, secret = do_create_api_key(tenant, "bench", admin, ["inference"])
    if not PriceSheet.objects.filter(model=MODEL).exists():
        PriceSheet.objects.create(
            model=MODEL,
            input_usd_per_mtok=Decimal("0.2"),
            cached_input_usd_per_mtok=Decimal("0.05"),
            output_usd_per_mtok=Decimal("0.6"),
            effective_from=datetime.now(UTC) - timedelta(days=1),
        )
    publish_price_book(client)
    client.hset(
        VISIBILITY_HASH,
        MODEL,
        orjson.dumps(
            {
                "kind": "model",
                "base_model": MODEL,
                "public": True,
                "tenants": [],
                "max_context": 131072,
                "created": 0,
            }
        ),
    )
    table = {
        "version": 1,
        "models": {
            MODEL: {
                "deployments": [
                    {
                        "deployment_id": "1",
                        "version": "v1",
                        "weight": 100,
                        "slo_tier": "standard",
                        "replicas": [
                            {
                                "replica_id": "bench-1",
                                "endpoint": upstream,
                                "pool": "h100",
                                "region": "us-east",
                                "gpu_class": "H100-SXM-80GB",
                                "model_spec": MODEL,
                                "price_per_hour": 3.49,
                                "tensor_parallel": 1,
                                "max_num_seqs": 1024,
                            }
                        ],
                    }
                ]
            }
        },
    }
    client.set(ROUTING_TABLE_KEY, orjson.dumps(table))
    # Telemetry that never goes stale during the run: the router sees an idle, fresh replica.
    client.hset(
        ROUTING_TELEMETRY_KEY,
        "bench-1",
        orjson.dumps({"running": 0, "waiting": 0, "kv": 0.0, "scraped_at": time.time() + 3600}),
    )
    return str(secret)


# --- load -------------------------------------------------------------------------------------


@dataclass
class Result:
    target: str
    concurrency: int
    completed: int
    errors: int
    seconds: float
    ttfts: list[float]

    @property
    def streams_per_s(self) -> float:
        return self.completed / self.seconds

    def pct(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def one_stream(session: aiohttp.ClientSession, url: str, key: str) -> float:
    # Usage is asked for, as a metered client does; it also spares LiteLLM from counting
    # tokens itself (it would look for a Hugging Face tokenizer it cannot download here).
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": TOKENS,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Say something short."}],
    }
    started = time.perf_counter()
    ttft = None
    tail = b""
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as reply:
        if reply.status != 200:
            await reply.read()
            raise RuntimeError(f"status {reply.status}")
        async for data in reply.content.iter_any():
            if ttft is None and b'"content":"' in data.replace(b'"content":""', b""):
                ttft = time.perf_counter() - started
            tail = (tail + data)[-64:]
        if b"[DONE]" not in tail:
            raise RuntimeError("stream ended without [DONE]")
    return ttft if ttft is not None else time.perf_counter() - started


async def load(target: str, url: str, key: str, concurrency: int, seconds: float) -> Result:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    result = Result(target, concurrency, 0, 0, seconds, [])
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, json_serialize=lambda v: orjson.dumps(v).decode()
    ) as session:
        for _ in range(min(concurrency, 20)):  # warm connections and caches
            with contextlib.suppress(Exception):
                await one_stream(session, url, key)
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                try:
                    result.ttfts.append(await one_stream(session, url, key))
                    result.completed += 1
                except Exception:
                    result.errors += 1

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - began
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--concurrency", default="1,50,200")
    parser.add_argument("--litellm", help="path to the litellm CLI of a venv with litellm[proxy]")
    parser.add_argument("--itl-ms", type=float, default=10)
    parser.add_argument("--ttft-ms", type=float, default=10)
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision to compare")
    parser.add_argument("--rounds", type=int, default=1, help="cells per target and concurrency")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    base_env = dict(os.environ)
    database = base_env.get(
        "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/platform_bench"
    )
    redis_url = base_env.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
    env = {
        **base_env,
        "DATABASE_URL": database,
        "REDIS_URL": redis_url,
        "DEBUG": "false",
        "SECRET_KEY": "bench-" + "k" * 60,
        "SECURE_SSL_REDIRECT": "false",
        "LOG_LEVEL": "WARNING",
        "PLATFORM_VAR_DIR": str(logs),
    }
    processes: list[subprocess.Popen[bytes]] = []
    try:
        sim_port = free_port()
        processes.append(
            start(
                [
                    sys.executable,
                    "-m",
                    "serving.enginesim",
                    MODEL,
                    "--served-model-name",
                    MODEL,
                    "--port",
                    str(sim_port),
                    "--sim-gpu-class",
                    "H100-SXM-80GB",
                    "--max-model-len",
                    "8192",
                    "--max-num-seqs",
                    "4096",
                    "--sim-fixed-ttft-ms",
                    str(args.ttft_ms),
                    "--sim-fixed-itl-ms",
                    str(args.itl_ms),
                ],
                env,
                logs / "sim.log",
            )
        )
        upstream = f"http://127.0.0.1:{sim_port}"
        wait_http(f"{upstream}/health")
        key = prepare_platform(env, upstream)

        ours_port = free_port()
        processes.append(start_gateway(ours_port, args.workers, env, logs / "ours.log"))
        consumer = start(
            [sys.executable, "manage.py", "metering_consume"], env, logs / "ingest.log"
        )
        processes.append(consumer)
        wait_http(f"http://127.0.0.1:{ours_port}/healthz")

        before_url = None
        if args.baseline:
            before_port = free_port()
            processes.append(
                start_gateway(
                    before_port, args.workers, env, logs / "before.log", args.baseline.resolve()
                )
            )
            wait_http(f"http://127.0.0.1:{before_port}/healthz")
            before_url = f"http://127.0.0.1:{before_port}/v1/chat/completions"

        litellm_url = None
        litellm_key = ""
        if args.litellm:
            config = logs / "litellm.yaml"
            config.write_text(
                "model_list:\n  - model_name: llama-3.1-8b\n    litellm_params:\n"
                f"      model: openai/{MODEL}\n      api_base: {upstream}/v1\n      api_key: none\n"
            )
            litellm_port = free_port()
            litellm_key = "sk-bench-" + os.urandom(16).hex()
            litellm_env = {
                k: v for k, v in base_env.items() if k not in {"DATABASE_URL", "REDIS_URL"}
            }
            # No network here: LiteLLM's bundled model cost map instead of fetching one.
            litellm_env.update(
                LITELLM_MASTER_KEY=litellm_key,
                LITELLM_LOCAL_MODEL_COST_MAP="True",
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1",
            )
            processes.append(
                start(
                    [
                        args.litellm,
                        "--config",
                        str(config),
                        "--port",
                        str(litellm_port),
                        "--num_workers",
                        str(args.workers),
                    ],
                    litellm_env,
                    logs / "litellm.log",
                )
            )
            wait_http(f"http://127.0.0.1:{litellm_port}/health/liveliness")
            litellm_url = f"http://127.0.0.1:{litellm_port}/v1/chat/completions"

        targets = [
            ("direct", f"{upstream}/v1/chat/completions", "none"),
            ("ours", f"http://127.0.0.1:{ours_port}/v1/chat/completions", key),
        ]
        if before_url:
            targets.append(("before", before_url, key))
        if litellm_url:
            targets.append(("litellm", litellm_url, litellm_key))
        results: list[Result] = []
        for level in levels:
            for round_ in range(args.rounds):
                # Alternate which of ours and before goes first, so neither always runs on
                # the other's warm machine.
                order = targets if round_ % 2 == 0 else [targets[0], *reversed(targets[1:])]
                for name, url, secret in order:
                    result = asyncio.run(load(name, url, secret, level, args.seconds))
                    results.append(result)
                    print(
                        f"  {name:8} c={level:<4} {result.streams_per_s:8.1f} streams/s "
                        f"p50 {result.pct(0.5):7.1f} ms  errors {result.errors}",
                        flush=True,
                    )
        print_table(merge_rounds(results), args)
        return 0
    finally:
        for process in reversed(processes):
            stop(process)
        print(f"logs: {logs}")


def merge_rounds(results: list[Result]) -> list[Result]:
    """One result per target and concurrency: the rounds' streams and TTFTs together."""
    merged: dict[tuple[str, int], Result] = {}
    for r in results:
        into = merged.setdefault(
            (r.target, r.concurrency), Result(r.target, r.concurrency, 0, 0, 0.0, [])
        )
        into.completed += r.completed
        into.errors += r.errors
        into.seconds += r.seconds
        into.ttfts.extend(r.ttfts)
    return list(merged.values())


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    direct = {r.concurrency: r for r in results if r.target == "direct"}
    print()
    print(
        f"{TOKENS}-token streams, {args.itl_ms:g} ms between tokens, upstream TTFT {args.ttft_ms:g} ms, "
        f"{args.workers} gateway workers, {args.seconds:g} s per cell, {args.rounds} round(s)"
    )
    header = (
        "target",
        "streams",
        "streams/s",
        "TTFT p50",
        "TTFT p99",
        "added p50",
        "added p99",
        "errors",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        base = direct[r.concurrency]
        added50 = "" if r.target == "direct" else f"{r.pct(0.5) - base.pct(0.5):.1f} ms"
        added99 = "" if r.target == "direct" else f"{r.pct(0.99) - base.pct(0.99):.1f} ms"
        print(
            f"| {r.target} | {r.concurrency} | {r.streams_per_s:.1f} | {r.pct(0.5):.1f} ms | "
            f"{r.pct(0.99):.1f} ms | {added50} | {added99} | {r.errors} |"
        )
    by = {(r.target, r.concurrency): r for r in results}
    top = max(r.concurrency for r in results)
    if ("litellm", top) in by:
        ratio = by[("ours", top)].streams_per_s / max(by[("litellm", top)].streams_per_s, 1e-9)
        print(
            f"\nours / litellm streams per second at {top} concurrent: {ratio:.1f}x (target >= 5x)"
        )
    for level in sorted(direct):
        if ("before", level) in by:
            ours, before = by[("ours", level)], by[("before", level)]
            print(
                f"ours / before at {level} concurrent: streams/s "
                f"{ours.streams_per_s / max(before.streams_per_s, 1e-9):.2f}x, TTFT p50 "
                f"{ours.pct(0.5) - before.pct(0.5):+.2f} ms, p99 {ours.pct(0.99) - before.pct(0.99):+.2f} ms"
            )
    if ("ours", 1) in by:
        added = by[("ours", 1)].pct(0.5) - direct[1].pct(0.5)
        print(f"ours added TTFT p50 at 1 stream: {added:.2f} ms (target <= 3 ms)")
    print(
        f"median of direct TTFTs at 1 stream: {statistics.median(direct[min(direct)].ttfts) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
