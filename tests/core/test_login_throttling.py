"""Login throttling through the real login pages (django-axes, config/auth.py): 5 failures per
username from any address, 20 per address over any usernames, then 429s for the cool-off."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from axes.models import AccessAttempt
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client

PASSWORD = "pw-for-tests-only"
# Rounds of the race between a success and failures of one user (one round rarely meets it).
ROUNDS = 20
LOCKED = "Too many failed attempts for this account or address; try again in 15 minutes."


@pytest.fixture
def admin_user(db: None) -> Any:
    return get_user_model().objects.create_user(
        "admin", password=PASSWORD, is_staff=True, is_superuser=True
    )


def from_address(address: str) -> Client:
    return Client(REMOTE_ADDR=address)


def log_in(client: Client, username: str, password: str, path: str = "/login/") -> Any:
    return client.post(path, {"username": username, "password": password})


def test_from_the_sixth_wrong_password_the_login_is_refused_with_a_429(admin_user: Any) -> None:
    client = from_address("203.0.113.7")
    replies = [log_in(client, "admin", f"wrong-{n}") for n in range(30)]

    assert [reply.status_code for reply in replies[:5]] == [200] * 5
    assert all(b"didn't match" in reply.content for reply in replies[:5])
    assert [reply.status_code for reply in replies[5:]] == [429] * 25
    assert all(LOCKED in reply.content.decode() for reply in replies[5:])


def test_a_locked_out_user_is_refused_even_with_the_right_password(admin_user: Any) -> None:
    client = from_address("203.0.113.7")
    for n in range(5):
        log_in(client, "admin", f"wrong-{n}")

    reply = log_in(client, "admin", PASSWORD)

    assert reply.status_code == 429
    assert LOCKED in reply.content.decode()
    assert "_auth_user_id" not in client.session


def test_the_lock_on_a_user_holds_from_every_address(admin_user: Any) -> None:
    attacker = from_address("203.0.113.7")
    for n in range(5):
        log_in(attacker, "admin", f"wrong-{n}")

    reply = log_in(from_address("198.51.100.20"), "admin", PASSWORD)

    assert reply.status_code == 429


def test_twenty_failures_from_one_address_over_other_usernames_lock_that_address(
    admin_user: Any,
) -> None:
    scanner = from_address("203.0.113.7")
    failures = [log_in(scanner, f"guess-{n}", "wrong").status_code for n in range(20)]

    assert failures == [200] * 20
    assert log_in(scanner, "guess-20", "wrong").status_code == 429
    assert log_in(scanner, "admin", PASSWORD).status_code == 429
    # the user itself is not locked: from another address the right password works
    assert log_in(from_address("198.51.100.20"), "admin", PASSWORD).status_code == 302


def test_a_successful_login_clears_the_users_failures(admin_user: Any) -> None:
    client = from_address("203.0.113.7")
    for n in range(4):
        log_in(client, "admin", f"wrong-{n}")
    assert log_in(client, "admin", PASSWORD).status_code == 302
    client.post("/logout/")

    # five more allowed failures: the count started again at the success
    later = [log_in(client, "admin", f"wrong-again-{n}").status_code for n in range(6)]

    assert later == [200] * 5 + [429]


def test_the_django_admin_login_is_throttled_the_same_way(admin_user: Any) -> None:
    client = from_address("203.0.113.7")
    replies = [log_in(client, "admin", f"wrong-{n}", "/admin/login/") for n in range(6)]

    assert [reply.status_code for reply in replies] == [200] * 5 + [429]
    assert LOCKED in replies[5].content.decode()
    assert log_in(client, "admin", PASSWORD, "/admin/login/").status_code == 429
    # another staff member, from another address, still logs in to the admin
    get_user_model().objects.create_user("ops", password=PASSWORD, is_staff=True)
    elsewhere = from_address("198.51.100.20")
    reply = log_in(elsewhere, "ops", PASSWORD, "/admin/login/")
    assert (reply.status_code, reply["Location"]) == (302, "/admin/")


def test_failures_on_the_console_and_the_admin_add_up(admin_user: Any) -> None:
    client = from_address("203.0.113.7")
    for n in range(3):
        log_in(client, "admin", f"wrong-{n}")
    for n in range(2):
        log_in(client, "admin", f"wrong-admin-{n}", "/admin/login/")

    assert log_in(client, "admin", PASSWORD, "/admin/login/").status_code == 429


def test_behind_a_proxy_failures_count_against_the_address_in_its_header(
    admin_user: Any, settings: Any
) -> None:
    settings.LOGIN_CLIENT_ADDRESS_HEADER = "HTTP_X_FORWARDED_FOR"
    # every request reaches Django from the proxy's address; the client put a fake entry first
    proxy = Client(REMOTE_ADDR="10.0.0.2")
    for n in range(20):
        proxy.post(
            "/login/",
            {"username": f"guess-{n}", "password": "wrong"},
            HTTP_X_FORWARDED_FOR=f"192.0.2.{n}, 203.0.113.7",
        )

    locked = proxy.post(
        "/login/",
        {"username": "admin", "password": PASSWORD},
        HTTP_X_FORWARDED_FOR="192.0.2.99, 203.0.113.7",
    )
    other_client = proxy.post(
        "/login/",
        {"username": "admin", "password": PASSWORD},
        HTTP_X_FORWARDED_FOR="198.51.100.20",
    )

    assert (locked.status_code, other_client.status_code) == (429, 302)


@pytest.mark.parametrize("path", ["/login/", "/admin/login/"])
@pytest.mark.parametrize("length", [151, 256, 100_000])
def test_a_username_longer_than_any_account_is_an_ordinary_failed_login_and_records_nothing(
    admin_user: Any, path: str, length: int
) -> None:
    """Django's login form never checks the username's length, and django-axes records it in
    a varchar(255): past 255 characters that was a DataError, a 500."""
    reply = log_in(from_address("203.0.113.7"), "x" * length, "wrong", path)

    assert reply.status_code == 200
    assert b"didn't match" in reply.content
    assert not AccessAttempt.objects.exists()


@pytest.mark.parametrize("races", [1, 2])
def test_a_failure_whose_record_met_a_racing_success_is_recorded_again(
    admin_user: Any, monkeypatch: pytest.MonkeyPatch, races: int
) -> None:
    """The race below, made certain: axes' recording meets an IntegrityError `races` times
    (a success deleted the row between its look-up and its insert); the failure is still
    counted once, and the login page answers as for any wrong password."""
    from axes.handlers.database import AxesDatabaseHandler
    from django.db import IntegrityError

    record = AxesDatabaseHandler.user_login_failed
    raced: list[int] = []

    def racing(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(raced) < races:
            raced.append(1)
            raise IntegrityError('duplicate key value violates "axes_accessattempt_username"')
        record(self, *args, **kwargs)

    monkeypatch.setattr(AxesDatabaseHandler, "user_login_failed", racing)
    reply = log_in(from_address("203.0.113.7"), "admin", "wrong")
    assert reply.status_code == 200
    assert b"didn't match" in reply.content
    assert [a.failures_since_start for a in AccessAttempt.objects.all()] == [1]


@pytest.mark.django_db(transaction=True)
def test_failures_racing_a_success_of_the_same_user_are_never_a_500() -> None:
    """A success deletes the user's rows while failures look theirs up and insert it again:
    axes' get_or_create then met a row that was there for its insert and gone for its second
    look (an IntegrityError, a 500). Each round races two right passwords and four wrong.
    Whether a round meets the race is up to the scheduler: the test above makes it certain."""
    get_user_model().objects.create_user("admin", password=PASSWORD)
    statuses: list[int] = []

    def log_in_at(start: threading.Barrier, password: str) -> None:
        client = Client(raise_request_exception=False, REMOTE_ADDR="203.0.113.7")
        start.wait()
        statuses.append(log_in(client, "admin", password).status_code)
        connection.close()

    for round_ in range(ROUNDS):
        start = threading.Barrier(6)
        passwords = [PASSWORD, PASSWORD] + [f"wrong-{round_}-{n}" for n in range(4)]
        threads = [threading.Thread(target=log_in_at, args=(start, p)) for p in passwords]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        AccessAttempt.objects.all().delete()  # no lock builds up over the rounds

    assert len(statuses) == 6 * ROUNDS
    assert set(statuses) <= {200, 302}
