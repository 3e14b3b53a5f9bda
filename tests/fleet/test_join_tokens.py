"""Join tokens: one pool's, expiring a day after they are minted unless told otherwise,
optionally single-use, minted by staff through the API with the secret shown once."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from serving.actions import credentials
from serving.models import GpuPool, JoinToken, Node

from .conftest import MakePool, Register

pytestmark = pytest.mark.django_db


def _register(secret: str, hostname: str) -> Any:
    return Client().post(
        "/api/agent/v1/register",
        {
            "join_token": secret,
            "hostname": hostname,
            "agent_url": f"http://{hostname}.local:9100",
            "gpus": [],
        },
        content_type="application/json",
    )


@pytest.fixture
def pool(make_pool: MakePool) -> GpuPool:
    made, _ = make_pool()
    return made


@pytest.fixture
def staff() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    return client


def test_a_join_token_expires_a_day_after_it_is_minted_by_default(pool: GpuPool) -> None:
    token, _ = credentials.do_create_join_token(pool)
    assert token.expires_at is not None
    lifetime = token.expires_at - timezone.now()
    assert timedelta(hours=23, minutes=59) < lifetime <= timedelta(hours=24)


def test_an_expired_join_token_is_refused_with_the_reason(pool: GpuPool) -> None:
    token, secret = credentials.do_create_join_token(pool, ttl=timedelta(hours=1))
    JoinToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    response = _register(secret, "gpu-1")

    assert response.status_code == 401
    assert "expired" in response.json()["error"]
    assert not Node.objects.filter(hostname="gpu-1").exists()


def test_a_single_use_join_token_is_refused_the_second_time(pool: GpuPool) -> None:
    _, secret = credentials.do_create_join_token(pool, single_use=True)

    first = _register(secret, "gpu-1")
    second = _register(secret, "gpu-2")

    assert first.status_code == 200
    assert second.status_code == 401
    assert "single-use join token has already registered a node" in second.json()["error"]
    assert list(Node.objects.values_list("hostname", flat=True)) == ["gpu-1"]


def test_a_refused_registration_does_not_use_up_a_single_use_token(
    pool: GpuPool, register: Register
) -> None:
    _, pool_secret = credentials.do_create_join_token(pool)
    register(pool_secret, "gpu-1")
    single, secret = credentials.do_create_join_token(pool, single_use=True)

    taken = _register(secret, "gpu-1")  # a registered hostname, without its node token

    assert taken.status_code == 409
    single.refresh_from_db()
    assert single.used_at is None
    assert _register(secret, "gpu-2").status_code == 200


def test_a_multi_use_token_admits_several_nodes(pool: GpuPool) -> None:
    _, secret = credentials.do_create_join_token(pool)
    assert [_register(secret, f"gpu-{n}").status_code for n in range(3)] == [200, 200, 200]


def test_a_revoked_join_token_is_refused(pool: GpuPool) -> None:
    token, secret = credentials.do_create_join_token(pool)
    credentials.do_revoke_join_token(token)
    response = _register(secret, "gpu-1")
    assert (response.status_code, response.json()["error"]) == (
        401,
        "unknown or revoked join token",
    )


def test_staff_mint_a_single_use_token_whose_secret_is_shown_once_and_stored_hashed(
    pool: GpuPool, staff: Client
) -> None:
    response = staff.post(
        "/api/v1/join-tokens/",
        {"pool": pool.name, "name": "rack-7", "ttl_hours": 2, "single_use": True},
        content_type="application/json",
    )

    assert response.status_code == 201, response.content
    minted = response.json()
    row = JoinToken.objects.get(pk=minted["id"])
    assert (row.pool, row.single_use, row.token_hash) == (
        pool,
        True,
        credentials.hash_token(minted["token"]),
    )
    assert row.expires_at is not None
    assert timedelta(hours=1, minutes=59) < row.expires_at - timezone.now() <= timedelta(hours=2)
    listed = staff.get("/api/v1/join-tokens/", {"pool": pool.name, "limit": "10"}).json()
    assert minted["token"] not in str(listed)
    assert "token" not in staff.get(f"/api/v1/join-tokens/{row.pk}/").json()
    assert _register(minted["token"], "gpu-1").status_code == 200


def test_the_api_mints_no_token_that_never_expires(pool: GpuPool, staff: Client) -> None:
    response = staff.post(
        "/api/v1/join-tokens/",
        {"pool": pool.name, "ttl_hours": None},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert not JoinToken.objects.filter(pool=pool, name="").exists()


def test_staff_revoke_a_join_token_through_the_api(pool: GpuPool, staff: Client) -> None:
    token, secret = credentials.do_create_join_token(pool)
    response = staff.post(f"/api/v1/join-tokens/{token.pk}/revoke/")
    assert (response.status_code, response.json()["revoked"]) == (200, True)
    assert _register(secret, "gpu-1").status_code == 401


def test_a_non_staff_user_cannot_mint_a_join_token(pool: GpuPool) -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_user("dev"))
    response = client.post(
        "/api/v1/join-tokens/", {"pool": pool.name}, content_type="application/json"
    )
    assert response.status_code == 403
    assert JoinToken.objects.filter(pool=pool).count() == 1  # the fixture's
