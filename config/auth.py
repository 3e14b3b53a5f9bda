"""Logging in: throttled by django-axes, with a TOTP second factor for staff (django-otp).

Throttling. Axes' backend runs first in every authenticate() (the console's /login/ and the
Django admin's login are the same view here) and refuses a locked-out client before the password
is checked. Its database handler keeps one AccessAttempt row per (username, address, user agent)
with a failure count; `LoginThrottle` adds up the recent rows per username and per address and
applies a limit to each (LOGIN_FAILURES_PER_USER, LOGIN_FAILURES_PER_ADDRESS). Refused attempts
are not recorded, so a lock ends a cool-off after the last real failure. A wrong second-factor
code is a failure like a wrong password. Success deletes the user's rows, never the address's.
A username longer than any account's is refused by the form (`LoginForm`) and recorded nowhere.
What it does not stop: a slow guesser under both limits (5 per user per 15 minutes by default),
and an attacker can lock a known username out on purpose; staff unlock it in the admin.

Second factor. The password step of a user with a confirmed TOTP device logs nobody in: it
parks the user in the session and asks for the code (`login_code`), which logs in and marks the
session verified. `StaffSecondFactorMiddleware` keeps staff sessions that are not verified out
of the console and the admin.
"""

from __future__ import annotations

import ipaddress
import math
import time
from base64 import b32encode
from typing import Any
from urllib.parse import urlencode

from axes.handlers.database import AxesDatabaseHandler
from axes.handlers.proxy import AxesProxyHandler
from axes.helpers import get_client_username, get_cool_off
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth import login as auth_login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.signals import user_login_failed
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError
from django.db.models import Max, Q, Sum
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect, render, resolve_url
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django_otp import login as otp_login
from django_otp import user_has_device
from django_otp.plugins.otp_totp.models import TOTPDevice

# Session keys of a login waiting for its code, and how long it waits.
PENDING_USER = "mfa_pending_user_id"
PENDING_BACKEND = "mfa_pending_backend"
PENDING_SINCE = "mfa_pending_since"
PENDING_SECONDS = 300
# How often a failure is recorded again after racing another login of the same user.
RECORD_FAILURE_TRIES = 3


def client_address(request: HttpRequest) -> str | None:
    """The address failures are counted against (AXES_CLIENT_IP_CALLABLE): REMOTE_ADDR, or the
    right-most entry of LOGIN_CLIENT_ADDRESS_HEADER, the one the trusted proxy wrote; entries to
    its left are whatever the client sent."""
    remote: str | None = request.META.get("REMOTE_ADDR")
    header = settings.LOGIN_CLIENT_ADDRESS_HEADER
    if header == "REMOTE_ADDR":
        return remote
    candidate = str(request.META.get(header, "")).rsplit(",", 1)[-1].strip()
    try:
        return str(ipaddress.ip_address(candidate))
    except ValueError:
        # not through the proxy (a probe, a pod-to-pod call): the peer is the client
        return remote


class LoginThrottle(AxesDatabaseHandler):
    """Axes' database handler with a limit per username and another per address."""

    def recent_attempts(self, request: HttpRequest, credentials: dict[str, Any] | None) -> Any:
        """The rows of this username or this address that are still within the cool-off."""
        match = Q(ip_address=request.axes_ip_address)  # type: ignore[attr-defined]
        username = get_client_username(request, credentials)
        if username:
            match |= Q(username=username)
        since = request.axes_attempt_time - get_cool_off(request)  # type: ignore[attr-defined]
        return AccessAttempt.objects.filter(match, attempt_time__gte=since)

    def is_locked(self, request: HttpRequest, credentials: dict[str, Any] | None = None) -> bool:
        address = request.axes_ip_address  # type: ignore[attr-defined]
        username = get_client_username(request, credentials)
        counts = self.recent_attempts(request, credentials).aggregate(
            by_address=Sum("failures_since_start", default=0, filter=Q(ip_address=address)),
            by_user=Sum("failures_since_start", default=0, filter=Q(username=username)),
        )
        by_user = counts["by_user"] if username else 0
        return bool(
            by_user >= settings.LOGIN_FAILURES_PER_USER
            or counts["by_address"] >= settings.LOGIN_FAILURES_PER_ADDRESS
        )

    def minutes_until_unlocked(
        self, request: HttpRequest, credentials: dict[str, Any] | None
    ) -> int:
        """An upper bound: when the newest failure that could hold the lock leaves the cool-off."""
        newest = self.recent_attempts(request, credentials).aggregate(at=Max("attempt_time"))["at"]
        if newest is None:
            return 1
        left = (newest + get_cool_off(request) - timezone.now()).total_seconds()
        return max(1, math.ceil(left / 60))

    def user_login_failed(
        self,
        sender: Any,
        credentials: dict[str, Any],
        request: HttpRequest | None = None,
        **kwargs: Any,
    ) -> None:
        """Axes' recording of a failure, tried again when it raced a login of the same user:
        a success deletes the row between axes' look-up and insert, or between the insert
        that met another failure's row and the look-up after it (an IntegrityError, a 500).
        Each try is its own transaction; the next one finds the row or creates it."""
        for _ in range(RECORD_FAILURE_TRIES - 1):
            try:
                super().user_login_failed(sender, credentials, request, **kwargs)
                return
            except IntegrityError:
                continue
        super().user_login_failed(sender, credentials, request, **kwargs)

    def user_logged_in(self, sender: Any, request: HttpRequest, user: Any, **kwargs: Any) -> None:
        super().user_logged_in(sender, request, user, **kwargs)
        self.reset_attempts(username=user.get_username())


class LoginForm(AuthenticationForm):
    """Django's login form, but a username longer than the user model allows (150) is the
    ordinary "invalid login" before authenticate() runs: django-axes would record it in a
    varchar(255), a DataError (a 500) past 255 characters. Django's form sets the field's
    max_length after its validators are built, so it never checks the length itself."""

    def clean(self) -> dict[str, Any]:
        username = self.cleaned_data.get("username") or ""
        if len(username) > (self.username_field.max_length or 150):
            raise self.get_invalid_login_error()
        return super().clean()


def lockout_response(request: HttpRequest, *args: Any) -> HttpResponse:
    """The login page with the reason, as a 429 (AXES_LOCKOUT_CALLABLE). Axes passes the
    original response and credentials, or under ASGI only the credentials: neither is needed."""
    AxesProxyHandler.update_request(request)
    credentials = getattr(request, "axes_credentials", None)
    minutes = AxesProxyHandler.get_implementation().minutes_until_unlocked(request, credentials)
    message = (
        "Too many failed attempts for this account or address; "
        f"try again in {minutes} minute{'s' if minutes != 1 else ''}."
    )
    context = {"form": LoginForm(request), "lockout": message}
    return render(request, "registration/login.html", context, status=429)


def safe_next(request: HttpRequest, default: str) -> str:
    target = request.POST.get("next") or request.GET.get("next") or ""
    allowed = url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    )
    return target if allowed else resolve_url(default)


class LoginView(auth_views.LoginView):
    """Django's login page; for a user with a confirmed TOTP device the password step only
    leads to the code step."""

    form_class = LoginForm

    def form_valid(self, form: AuthenticationForm) -> HttpResponse:
        user = form.get_user()
        if not user_has_device(user):
            return super().form_valid(form)
        self.request.session[PENDING_USER] = user.pk
        self.request.session[PENDING_BACKEND] = user.backend
        self.request.session[PENDING_SINCE] = time.time()
        query = urlencode({"next": self.get_success_url()})
        return HttpResponseRedirect(f"{reverse('login-code')}?{query}")


def pending_user(request: HttpRequest) -> Any | None:
    user_id = request.session.get(PENDING_USER)
    since = request.session.get(PENDING_SINCE, 0)
    if user_id is None or time.time() - since > PENDING_SECONDS:
        return None
    return get_user_model().objects.filter(pk=user_id).first()


def login_code(request: HttpRequest) -> HttpResponse:
    """The second step: a valid code from the user's device logs them in, verified."""
    user = pending_user(request)
    if user is None:
        return redirect_to_login(safe_next(request, settings.LOGIN_REDIRECT_URL))
    context: dict[str, Any] = {"next": safe_next(request, settings.LOGIN_REDIRECT_URL)}
    if request.method == "POST":
        credentials = {"username": user.get_username()}
        if not AxesProxyHandler.is_allowed(request, credentials):
            request.axes_credentials = credentials  # type: ignore[attr-defined]
            return lockout_response(request)
        code = request.POST.get("code", "").strip()
        device = next(
            (d for d in TOTPDevice.objects.devices_for_user(user, confirmed=True)
             if d.verify_token(code)),
            None,
        )  # fmt: skip
        if device is None:
            user_login_failed.send(__name__, credentials=credentials, request=request)
            context["error"] = "That code is not valid. Enter the 6 digits your app shows now."
        else:
            backend = request.session[PENDING_BACKEND]
            for key in (PENDING_USER, PENDING_BACKEND, PENDING_SINCE):
                request.session.pop(key, None)
            auth_login(request, user, backend=backend)
            otp_login(request, device)
            return HttpResponseRedirect(context["next"])
    return render(request, "registration/login_code.html", context)


@login_required
def enroll_device(request: HttpRequest) -> HttpResponse:
    """A staff member adds an authenticator app: the page shows the otpauth:// URL and the
    secret, and the first valid code confirms the device."""
    user: Any = request.user
    if not user.is_staff:
        raise PermissionDenied("Two-factor enrolment is for platform staff.")
    if user_has_device(user):
        return render(request, "registration/two_factor_enroll.html", {"enrolled": True})
    device = TOTPDevice.objects.filter(user=user, confirmed=False).first()
    if device is None:
        device = TOTPDevice.objects.create(user=user, name="Authenticator app", confirmed=False)
    context: dict[str, Any] = {
        "config_url": device.config_url,
        "secret": b32encode(device.bin_key).decode(),
        "next": safe_next(request, "home"),
    }
    if request.method == "POST":
        if device.verify_token(request.POST.get("code", "").strip()):
            device.confirmed = True
            device.save(update_fields=["confirmed"])
            otp_login(request, device)
            messages.success(request, "Two-factor authentication is on for your account.")
            return HttpResponseRedirect(context["next"])
        context["error"] = "That code is not valid. Enter the 6 digits your app shows now."
    return render(request, "registration/two_factor_enroll.html", context)


class StaffSecondFactorMiddleware:
    """Staff reach the console and the admin only with a verified session when they have a
    device (a session from before it was confirmed goes back to the login), and, with
    PLATFORM_STAFF_MFA_REQUIRED, only after enrolling one."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        refusal = self.refusal(request)
        return refusal if refusal is not None else self.get_response(request)

    def refusal(self, request: HttpRequest) -> HttpResponse | None:
        user: Any = request.user
        if not (user.is_authenticated and user.is_staff):
            return None
        guarded = ("/console/", reverse("admin:index"))
        if not request.path.startswith(guarded) or user.is_verified():
            return None
        if user_has_device(user):
            return redirect_to_login(request.get_full_path())
        if settings.PLATFORM_STAFF_MFA_REQUIRED:
            query = urlencode({"next": request.get_full_path()})
            return redirect(f"{reverse('two-factor-enroll')}?{query}")
        return None


class PlatformAdminSite(admin.AdminSite):
    """The Django admin, logging in through the same throttled, two-step page as the console."""

    def login(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        if request.method == "GET" and self.has_permission(request):
            return HttpResponseRedirect(reverse("admin:index", current_app=self.name))
        return LoginView.as_view(next_page=reverse("admin:index", current_app=self.name))(request)
