"""Every query of the Grafana dashboard returns data from a real Prometheus.

Prometheus (Debian's /usr/bin/prometheus) scrapes a running gateway, with the bearer token
from a file as scrape.yaml does, and two engine simulators, one second apart. Traffic goes
through the gateway, one engine dies under it and an admission times out on a slow Redis,
so the failure panels have something to show. A panel whose query names a metric or a
label nothing exports comes back empty and fails here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from pytest_django import Settings

from tenants.actions import do_create_api_key, do_create_tenant
from tenants.limiter import ADMIT_SCRIPT
from tests.gateway.conftest import (
    MODEL,
    Fleet,
    GatewayServer,
    free_port,
    publish_catalog,
    wait_http,
    wait_until,
)
from tests.gateway.redis_proxy import RedisProxy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "platform" / "grafana" / "platform-overview.json"
ALERTS = ROOT / "platform" / "prometheus" / "alerts.yaml"
TOKEN = "scrape-token-for-the-dashboard-test-0123456789"
# What Grafana puts in for the dashboard's variables when "All" is selected.
VARIABLES = {"$__rate_interval": "30s", "$model": ".*", "$pool": ".*", "$tenant": ".*"}
LABEL_VALUES = "label_values("
# How the Redis proxy knows the admission script (EVALSHA names it by its digest).
ADMIT_SCRIPT_SHA = hashlib.sha1(ADMIT_SCRIPT.encode()).hexdigest().encode()


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    def query(self, expr: str) -> list[dict[str, Any]]:
        reply = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        assert reply.status_code == 200, f"{expr}: {reply.text}"
        result: list[dict[str, Any]] = reply.json()["data"]["result"]
        return result

    def label_values(self, metric: str, label: str) -> list[str]:
        reply = httpx.get(
            f"{self.url}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10
        )
        assert reply.status_code == 200, reply.text
        values: list[str] = reply.json()["data"]
        return values


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, expression with the variables put in) for every panel target."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append((panel["title"], expr))
    return queries


def variable_queries() -> list[tuple[str, str, str]]:
    """(variable, metric, label) of every `label_values(metric, label)` variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict) and query["query"].startswith(LABEL_VALUES):
            metric, label = query["query"].removeprefix(LABEL_VALUES).rstrip(")").split(",")
            found.append((variable["name"], metric.strip(), label.strip()))
    return found


def prometheus_config(gateway_port: int, fleet: Fleet, token_file: Path) -> dict[str, Any]:
    engines = [
        {
            "targets": [f"127.0.0.1:{sim.port}"],
            "labels": {"pool": sim.pool, "replica": sim.replica_id},
        }
        for sim in fleet.sims
    ]
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": "llm-platform-gateway",
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
                "static_configs": [{"targets": [f"127.0.0.1:{gateway_port}"]}],
            },
            {"job_name": "llm-platform-engines", "static_configs": engines},
        ],
    }


@pytest.fixture
def proxy(redis_client: redis.Redis) -> Iterator[RedisProxy]:
    running = RedisProxy(django_settings.REDIS_URL).start()
    yield running
    running.stop()


@pytest.fixture
def gateway_server(transactional_db: None, redis_client: redis.Redis) -> Iterator[GatewayServer]:
    server = GatewayServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fleet(redis_client: redis.Redis) -> Iterator[Fleet]:
    running = Fleet(redis_client)
    yield running
    running.stop()


@pytest.fixture
def secret(transactional_db: None) -> str:
    admin = get_user_model().objects.create_user("platform-admin", is_staff=True)
    tenant = do_create_tenant("acme", "Acme")
    _, secret = do_create_api_key(tenant, "acme key", admin, ("inference",), ())
    return secret


@pytest.fixture
def prometheus(
    tmp_path: Path, settings: Settings, gateway_server: GatewayServer, fleet: Fleet
) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    assert Path(binary).exists(), (
        "prometheus is not installed: install Debian's prometheus package "
        "(apt-get install prometheus), which provides /usr/bin/prometheus"
    )
    settings.PLATFORM_METRICS_TOKEN = TOKEN
    fleet.start(pool="h100-a")
    fleet.start(pool="h100-a")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(gateway_server.port, fleet, token_file)))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    running = Prometheus(f"http://127.0.0.1:{port}", process)
    try:
        wait_http(f"{running.url}/-/ready", process=process)
        yield running
    finally:
        process.terminate()
        process.wait(timeout=15)
        log.close()


def chat(http: httpx.Client, *, stream: bool) -> httpx.Response:
    return http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "stream": stream,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello there"}],
        },
    )


def send_faults(http: httpx.Client, fleet: Fleet, proxy: RedisProxy) -> None:
    """One engine dies and one admission times out on a slow Redis."""
    # The gateway's connections to the dead engine fail until its breaker opens.
    fleet.sims[1].stop()
    for _ in range(8):
        chat(http, stream=True)
    # Redis answers the admission script after the limiter's timeout: a 503, fail closed.
    proxy.slow_for = ADMIT_SCRIPT_SHA
    proxy.delay_s = 1.0
    assert chat(http, stream=True).status_code == 503
    proxy.delay_s = 0.0


@contextlib.contextmanager
def steady_traffic(http: httpx.Client) -> Iterator[None]:
    """Requests keep coming, so that rate() over the scrapes sees counters rise."""
    stopping = threading.Event()

    def send() -> None:
        while not stopping.is_set():
            chat(http, stream=True)
            stopping.wait(0.2)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        stopping.set()
        sender.join(timeout=30)


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    settings: Settings,
    proxy: RedisProxy,
    gateway_server: GatewayServer,
    fleet: Fleet,
    prometheus: Prometheus,
    secret: str,
    redis_client: redis.Redis,
) -> None:
    settings.REDIS_URL = proxy.url  # the gateway starts on its first request, behind the proxy
    publish_catalog(redis_client)
    fleet.publish()
    queries = panel_queries()
    assert queries
    empty: list[str] = []

    def answers(expr: str) -> bool:
        # NaN is what histogram_quantile makes of no observations: nothing to draw.
        return any(series["value"][1] != "NaN" for series in prometheus.query(expr))

    def all_answer() -> bool:
        empty[:] = [f"{title}: {expr}" for title, expr in queries if not answers(expr)]
        return not empty

    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway_server.url, headers=headers, timeout=30) as http:
        assert chat(http, stream=True).status_code == 200
        # Scraped with the token from the file (without it, the gateway answers 401).
        assert wait_until(
            lambda: bool(prometheus.query('up{job="llm-platform-gateway"} == 1')), timeout_s=15
        ), "Prometheus cannot scrape the gateway"
        send_faults(http, fleet, proxy)
        with steady_traffic(http):
            assert wait_until(all_answer, timeout_s=30, step_s=1), (
                "panels without data:\n" + "\n".join(empty)
            )
    for name, metric, label in variable_queries():
        assert prometheus.label_values(metric, label), f"variable {name} has no values"
