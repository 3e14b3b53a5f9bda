"""The staff second factor (django-otp TOTP, config/auth.py): the code step after the password,
on the console's login and the admin's, enrolment, and PLATFORM_STAFF_MFA_REQUIRED."""

from __future__ import annotations

import re
from base64 import b32decode
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django_otp.oath import totp
from django_otp.plugins.otp_totp.models import TOTPDevice

PASSWORD = "pw-for-tests-only"
LOCKED = "Too many failed attempts for this account or address; try again in 15 minutes."


@pytest.fixture
def ops(db: None) -> Any:
    return get_user_model().objects.create_user(
        "ops", password=PASSWORD, is_staff=True, is_superuser=True
    )


@pytest.fixture
def ops_device(ops: Any) -> TOTPDevice:
    return TOTPDevice.objects.create(user=ops, name="phone", confirmed=True)


def code_of(device: TOTPDevice) -> str:
    return f"{totp(device.bin_key, step=device.step, t0=device.t0, digits=device.digits):06d}"


def wrong_code_for(device: TOTPDevice) -> str:
    return f"{(int(code_of(device)) + 500_000) % 1_000_000:06d}"


def logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


def test_staff_with_a_device_are_asked_for_a_code_after_the_password(
    ops_device: TOTPDevice,
) -> None:
    client = Client()
    reply = client.post("/login/", {"username": "ops", "password": PASSWORD, "next": "/console/"})

    assert reply.status_code == 302
    assert reply["Location"].startswith("/login/code/")
    assert not logged_in(client)
    assert client.get("/console/").status_code == 302


def test_a_valid_code_logs_in_and_opens_the_console(ops_device: TOTPDevice) -> None:
    client = Client()
    client.post("/login/", {"username": "ops", "password": PASSWORD, "next": "/console/"})

    reply = client.post("/login/code/", {"code": code_of(ops_device), "next": "/console/"})

    assert (reply.status_code, reply["Location"]) == (302, "/console/")
    assert logged_in(client)
    assert client.get("/console/").status_code == 200


def test_a_wrong_code_is_refused_with_a_message(ops_device: TOTPDevice) -> None:
    client = Client()
    client.post("/login/", {"username": "ops", "password": PASSWORD})

    reply = client.post("/login/code/", {"code": wrong_code_for(ops_device)})

    assert reply.status_code == 200
    assert "That code is not valid" in reply.content.decode()
    assert not logged_in(client)


def test_wrong_codes_count_toward_the_lockout(ops_device: TOTPDevice) -> None:
    client = Client()
    client.post("/login/", {"username": "ops", "password": PASSWORD})
    for _ in range(5):
        client.post("/login/code/", {"code": wrong_code_for(ops_device)})

    reply = client.post("/login/code/", {"code": code_of(ops_device)})

    assert reply.status_code == 429
    assert LOCKED in reply.content.decode()
    assert not logged_in(client)


def test_the_code_step_without_a_password_first_goes_back_to_the_login(
    ops_device: TOTPDevice,
) -> None:
    client = Client()

    reply = client.post("/login/code/", {"code": code_of(ops_device)})

    assert reply.status_code == 302 and reply["Location"].startswith("/login/")
    assert not logged_in(client)


def test_the_admin_login_asks_for_the_code_too(ops_device: TOTPDevice) -> None:
    client = Client()
    reply = client.post("/admin/login/", {"username": "ops", "password": PASSWORD})

    assert reply["Location"].startswith("/login/code/")
    assert client.get("/admin/").status_code == 302
    reply = client.get(reply["Location"])
    assert 'name="next" value="/admin/"' in reply.content.decode()
    reply = client.post("/login/code/", {"code": code_of(ops_device), "next": "/admin/"})
    assert reply["Location"] == "/admin/"
    assert client.get("/admin/").status_code == 200


def test_staff_without_a_device_log_in_with_the_password_alone(ops: Any) -> None:
    client = Client()

    reply = client.post("/login/", {"username": "ops", "password": PASSWORD})

    assert reply.status_code == 302 and not reply["Location"].startswith("/login/code/")
    assert client.get("/console/").status_code == 200


def test_a_session_that_skipped_the_code_is_kept_out_of_the_console_and_admin(
    ops_device: TOTPDevice,
) -> None:
    client = Client()
    client.force_login(ops_device.user)

    assert client.get("/console/")["Location"].startswith("/login/?next=/console/")
    assert client.get("/admin/")["Location"].startswith("/login/?next=/admin/")


def test_enrolment_shows_the_setup_link_and_the_first_code_confirms_it(ops: Any) -> None:
    client = Client()
    client.force_login(ops)

    page = client.get("/login/two-factor/").content.decode()
    secret = re.search(r'id="id_secret" value="([A-Z2-7]+)"', page)
    assert secret is not None
    assert "otpauth://totp/Inference%20platform%3Aops?secret=" + secret[1] in page
    device = TOTPDevice.objects.get(user=ops)
    assert b32decode(secret[1]) == device.bin_key and not device.confirmed

    reply = client.post("/login/two-factor/", {"code": code_of(device), "next": "/console/"})

    assert (reply.status_code, reply["Location"]) == (302, "/console/")
    device.refresh_from_db()
    assert device.confirmed
    # the session that confirmed the device counts as verified
    assert client.get("/console/").status_code == 200


def test_a_wrong_enrolment_code_leaves_the_device_unconfirmed(ops: Any) -> None:
    client = Client()
    client.force_login(ops)
    client.get("/login/two-factor/")
    device = TOTPDevice.objects.get(user=ops)

    reply = client.post("/login/two-factor/", {"code": wrong_code_for(device)})

    assert "That code is not valid" in reply.content.decode()
    device.refresh_from_db()
    assert not device.confirmed


def test_enrolment_is_for_staff_only(db: None) -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_user("dev"))

    assert client.get("/login/two-factor/").status_code == 403


def test_with_mfa_required_staff_without_a_device_are_sent_to_enrol(
    ops: Any, settings: Any
) -> None:
    settings.PLATFORM_STAFF_MFA_REQUIRED = True
    client = Client()
    client.force_login(ops)

    for path in ("/console/", "/console/fleet/", "/console/planner/", "/admin/"):
        reply = client.get(path)
        assert reply.status_code == 302
        assert reply["Location"].startswith("/login/two-factor/?next=")


def test_mfa_is_not_required_by_default(ops: Any) -> None:
    client = Client()
    client.force_login(ops)

    assert client.get("/console/").status_code == 200
