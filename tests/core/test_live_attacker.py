"""An attacker on the same network as a live `make run`: the demo fleet, its join tokens in
var/demo.json, its engines' ports. One `make run` for the module; the login lockout runs last,
since 30 failures lock the admin and (past 20) the whole address out for the cool-off."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.core.test_make_run import (
    ROOT,
    chat_status,
    free_port,
    run_environment,
    wait_for_line,
    wait_for_readyz,
)

pytestmark = pytest.mark.slow

# The demo's model that the banner waits for (scripts/run.py DEMO_MODEL): chat_status calls it.
SERVED_MODEL = "llama-3.1-8b"
TENANT_SLUGS = ("acme", "globex")
# Known here, so the test can rebuild a replica's engine key (serving.actions.credentials).
SECRET_KEY = "live-attacker-" + secrets.token_hex(32)
METRICS_TOKEN = "scrape-" + secrets.token_hex(16)
LOGIN_THROTTLE_MESSAGE = "Too many failed attempts for this account or address"


@dataclass(frozen=True)
class LiveDemo:
    port: int
    details: dict[str, Any]
    staff: httpx.Client  # logged in as the demo admin

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def login(client: httpx.Client, username: str, password: str) -> httpx.Response:
    """The login form as a browser submits it: its CSRF token, then the POST."""
    form = client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
    assert token is not None, form.text[:500]
    return client.post(
        "/login/",
        data={"csrfmiddlewaretoken": token[1], "username": username, "password": password},
    )


@pytest.fixture(scope="module")
def live_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDemo]:
    tmp_path = tmp_path_factory.mktemp("live-attacker")
    port = free_port()
    env = run_environment(tmp_path, port)
    # As deployed: a scrape token, a real secret key; no demo traffic competing for 2 cores.
    env.update(
        PLATFORM_METRICS_TOKEN=METRICS_TOKEN, SECRET_KEY=SECRET_KEY, PLATFORM_DEMO_TRAFFIC="0"
    )
    process = subprocess.Popen(
        [sys.executable, "scripts/run.py"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines: list[str] = []
    assert process.stdout is not None
    stdout = process.stdout
    reader = threading.Thread(
        target=lambda: lines.extend(line.decode(errors="replace") for line in stdout), daemon=True
    )
    reader.start()
    staff = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        assert wait_for_readyz(port, process, timeout_s=180) == 200
        wait_for_line(lines, "The platform is up.", process, timeout_s=240)
        details = orjson.loads((tmp_path / "var" / "demo.json").read_bytes())
        logged_in = login(staff, details["admin_username"], details["admin_password"])
        assert logged_in.status_code == 302, logged_in.text[:500]
        yield LiveDemo(port, details, staff)
    finally:
        staff.close()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        reader.join(timeout=10)
        print("".join(lines)[-5000:])


def staff_list(demo: LiveDemo, path: str) -> list[dict[str, Any]]:
    reply = demo.staff.get(path, params={"limit": 100})
    assert reply.status_code == 200, reply.text[:500]
    results: list[dict[str, Any]] = reply.json()["results"]
    return results


def node(demo: LiveDemo, node_id: int) -> dict[str, Any]:
    reply = demo.staff.get(f"/api/v1/nodes/{node_id}/")
    assert reply.status_code == 200, reply.text[:500]
    found: dict[str, Any] = reply.json()
    return found


@dataclass(frozen=True)
class ServingReplica:
    replica: dict[str, Any]
    node: dict[str, Any]

    @property
    def engine_url(self) -> str:
        host = urlsplit(self.node["agent_url"]).hostname
        return f"http://{host}:{self.replica['port']}"


def serving_replica(demo: LiveDemo) -> ServingReplica:
    """A ready replica of the served model, with its node, as the staff API lists them."""
    models = {d["id"]: d["model"] for d in staff_list(demo, "/api/v1/deployments/")}
    nodes = {n["hostname"]: n for n in staff_list(demo, "/api/v1/nodes/")}
    ready = [
        r
        for r in staff_list(demo, "/api/v1/replicas/")
        if r["state"] == "ready" and models.get(r["deployment"]) == SERVED_MODEL and r["port"]
    ]
    assert ready, f"no ready replica of {SERVED_MODEL}"
    return ServingReplica(ready[0], nodes[ready[0]["node"]])


def engine_status(url: str, method: str, headers: dict[str, str]) -> int:
    body = {"model": SERVED_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    if method == "GET":
        return httpx.get(url, headers=headers, timeout=10).status_code
    return httpx.post(url, json=body, headers=headers, timeout=10).status_code


def test_the_pools_join_token_does_not_take_over_a_registered_node(live_demo: LiveDemo) -> None:
    target = serving_replica(live_demo)
    before = target.node
    join_token = live_demo.details["fleet"]["join_tokens"][before["pool"]]

    reply = httpx.post(
        f"{live_demo.url}/api/agent/v1/register",
        json={
            "join_token": join_token,
            "hostname": before["hostname"],
            "agent_url": "http://10.66.6.6:9999",
            "gpus": [{"index": 0, "name": "NVIDIA H100", "memory_mb": 81920}],
        },
        timeout=30,
    )

    assert reply.status_code == 409, reply.text
    assert "already registered" in reply.json()["error"]
    assert "node_token" not in reply.json()
    after = node(live_demo, before["id"])
    assert after["agent_url"] == before["agent_url"]
    assert after["registered_at"] == before["registered_at"]
    assert after["gpus"] == before["gpus"]
    # The real agent's token still works: a takeover would have drawn a new nonce.
    deadline = time.monotonic() + 15
    while node(live_demo, before["id"])["last_heartbeat_at"] == before["last_heartbeat_at"]:
        assert time.monotonic() < deadline, "the node stopped heartbeating after the attempt"
        time.sleep(0.5)
    replica = live_demo.staff.get(f"/api/v1/replicas/{target.replica['id']}/").json()
    assert replica["state"] == "ready" and replica["node"] == before["hostname"]
    assert chat_status(live_demo.port, live_demo.details["acme_api_key"]) == 200


def test_an_engine_port_refuses_callers_without_its_key(live_demo: LiveDemo) -> None:
    target = serving_replica(live_demo)
    engine = target.engine_url
    wrong = {"Authorization": "Bearer ek_" + "0" * 64}

    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        assert engine_status(engine + path, method, {}) == 401, path
        assert engine_status(engine + path, method, wrong) == 401, path
        assert engine_status(engine + path, method, {"Authorization": "Basic eDp4"}) == 401, path

    # The same port, with the key the gateway sends (HMAC of the secret key and the replica id).
    digest = hmac.new(
        SECRET_KEY.encode(), f"engine:{target.replica['id']}".encode(), hashlib.sha256
    ).hexdigest()
    right = {"Authorization": f"Bearer ek_{digest}"}
    assert engine_status(engine + "/v1/models", "GET", right) == 200


def test_metrics_on_the_public_port_name_no_tenant_without_the_scrape_token(
    live_demo: LiveDemo,
) -> None:
    # Traffic first, so the tenants' series exist to be leaked.
    assert chat_status(live_demo.port, live_demo.details["acme_api_key"]) == 200
    metrics = f"{live_demo.url}/metrics"
    attempts = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {live_demo.details['acme_api_key']}"},
        {"Authorization": f"Basic {METRICS_TOKEN}"},
        {"X-Forwarded-For": "127.0.0.1"},
    ]
    for headers in attempts:
        reply = httpx.get(metrics, headers=headers, timeout=10)
        leaked = [slug for slug in TENANT_SLUGS if slug in reply.text]
        assert reply.status_code in {401, 403, 404} or not leaked, (headers, leaked)
    # The scraper's token reads them: the refusals above are of a page that does name tenants.
    scraped = httpx.get(metrics, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10)
    assert scraped.status_code == 200 and 'tenant="acme"' in scraped.text


def test_an_unauthenticated_websocket_is_closed_within_the_auth_deadline(
    live_demo: LiveDemo,
) -> None:
    url = f"ws://127.0.0.1:{live_demo.port}/v1/chat/completions/ws"
    opened = time.monotonic()
    with connect(url, open_timeout=10) as socket:
        reply = orjson.loads(socket.recv(timeout=11))
        with pytest.raises(ConnectionClosed):
            socket.recv(timeout=11 - (time.monotonic() - opened))
        closed_after = time.monotonic() - opened
        assert socket.close_code == 4401
    assert reply["type"] == "error" and reply["error"]["code"] == "invalid_api_key"
    assert closed_after <= 11.0, closed_after


def test_thirty_wrong_passwords_lock_the_admin_out_even_with_the_right_one(
    live_demo: LiveDemo,
) -> None:
    username = live_demo.details["admin_username"]
    with httpx.Client(base_url=live_demo.url, timeout=30) as attacker:
        replies = [login(attacker, username, f"guess-{n}") for n in range(30)]
        locked = login(attacker, username, live_demo.details["admin_password"])
        assert attacker.get("/api/v1/nodes/").status_code == 403

    assert [reply.status_code for reply in replies[:5]] == [200] * 5
    assert [reply.status_code for reply in replies[5:]] == [429] * 25
    assert all(LOGIN_THROTTLE_MESSAGE in reply.text for reply in replies[5:])
    assert locked.status_code == 429
    assert LOGIN_THROTTLE_MESSAGE in locked.text
    assert "sessionid" not in locked.cookies
