"""/metrics names every tenant with its models and token volumes: only the scraper reads it.

Through the real ASGI application (config.asgi), as a caller at a given address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import yaml
from pytest_django import Settings

from serving.gateway import metrics

ROOT = Path(__file__).resolve().parents[2]
TENANT = "initech-metrics-probe"
TOKEN = "scrape-token-for-tests-only-0123456789"


@pytest.fixture(autouse=True)
def tenant_series() -> None:
    metrics.TOKENS.labels(TENANT, "llama-3.1-8b", "prompt").inc(7)


async def get_metrics(client: tuple[str, int], headers: dict[str, str] | None = None):
    from config.asgi import application

    transport = httpx.ASGITransport(app=cast(Any, application), client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        return await http.get("/metrics", headers=headers or {})


async def test_without_a_token_setting_a_remote_caller_gets_404_and_no_tenant(
    settings: Settings,
) -> None:
    settings.PLATFORM_METRICS_TOKEN = ""
    response = await get_metrics(("203.0.113.9", 40000))
    assert response.status_code == 404
    assert TENANT not in response.text


async def test_without_a_token_setting_a_loopback_caller_reads_the_series(
    settings: Settings,
) -> None:
    settings.PLATFORM_METRICS_TOKEN = ""
    response = await get_metrics(("127.0.0.1", 40000))
    assert response.status_code == 200
    assert f'tenant="{TENANT}"' in response.text


async def test_a_proxied_request_is_not_loopback_even_from_a_local_proxy(
    settings: Settings,
) -> None:
    settings.PLATFORM_METRICS_TOKEN = ""
    response = await get_metrics(("127.0.0.1", 40000), {"X-Forwarded-For": "127.0.0.1"})
    assert response.status_code == 404
    assert TENANT not in response.text


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x"]
)
async def test_with_a_token_setting_a_caller_without_it_gets_401_and_no_tenant(
    settings: Settings, authorization: str | None
) -> None:
    settings.PLATFORM_METRICS_TOKEN = TOKEN
    headers = {"Authorization": authorization} if authorization else {}
    # Loopback too: with a token set, the token is the only way in.
    for client in (("203.0.113.9", 40000), ("127.0.0.1", 40000)):
        response = await get_metrics(client, headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert TENANT not in response.text


async def test_with_the_token_the_scraper_reads_the_series(settings: Settings) -> None:
    settings.PLATFORM_METRICS_TOKEN = TOKEN
    response = await get_metrics(("10.0.7.3", 40000), {"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200
    series = (
        f'platform_gateway_tokens_total{{kind="prompt",model="llama-3.1-8b",tenant="{TENANT}"}}'
    )
    assert series in response.text


def test_prometheus_scrapes_the_gateways_with_the_token_from_a_file() -> None:
    scrape = yaml.safe_load((ROOT / "platform/prometheus/scrape.yaml").read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "llm-platform-gateway")
    assert job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"]


def ingress_routes(path: str) -> bool:
    ingress = yaml.safe_load((ROOT / "platform/kubernetes/ingress.yaml").read_text())
    for rule in ingress["spec"]["rules"]:
        for entry in rule["http"]["paths"]:
            if entry["pathType"] == "Exact" and entry["path"] == path:
                return True
            prefix = entry["path"].rstrip("/")
            if entry["pathType"] == "Prefix" and (path == prefix or path.startswith(prefix + "/")):
                return True
    return False


def test_the_ingress_routes_every_top_level_path_of_the_site() -> None:
    from config.urls import urlpatterns

    tops = {"/" + str(cast(Any, pattern).pattern).split("/", 1)[0] for pattern in urlpatterns}
    tops |= {"/v1"}  # the gateway app, ahead of Django (serving/gateway/asgi.py)
    missing = sorted(path for path in tops if not ingress_routes(path))
    assert not missing, f"platform/kubernetes/ingress.yaml does not route {missing}"
    assert not ingress_routes("/metrics")
