"""The console's staff tokens page (/console/tokens/): a staff member's own tokens, a form to
create one and a button to revoke each.

Both forms POST, then redirect back to the page (so a refresh mints nothing). A new token's
secret crosses that redirect in the session (database-backed; never in a message, whose
storage may be a cookie) and is popped by the page that shows it, once.
"""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from config.views import staff_required
from tenants import staff_token_actions as actions
from tenants.staff_tokens import MAX_LIFETIME, StaffTokenScope

NEW_TOKEN_SESSION_KEY = "new_staff_token"
DEFAULT_LIFETIME_DAYS = 30


def _errors_text(error: ValidationError) -> str:
    if hasattr(error, "error_dict"):
        return "; ".join(
            f"{field}: {msg}" for field, msgs in error.message_dict.items() for msg in msgs
        )
    return "; ".join(error.messages)


@staff_required
def staff_tokens_page(request: HttpRequest) -> HttpResponse:
    new_token = request.session.pop(NEW_TOKEN_SESSION_KEY, None)
    context = {
        "tokens": actions.staff_tokens_for_user(request.user),
        "scopes": StaffTokenScope.choices,
        "max_days": MAX_LIFETIME.days,
        "default_days": DEFAULT_LIFETIME_DAYS,
        "new_token": new_token,
        "now": timezone.now(),
    }
    response = render(request, "console/staff_tokens.html", context)
    if new_token is not None:
        # Shown once: the page carrying the secret must not be cached anywhere.
        response["Cache-Control"] = "no-store"
    return response


@staff_required
@require_POST
def create_staff_token(request: HttpRequest) -> HttpResponse:
    try:
        days = int(request.POST.get("lifetime_days", ""))
        expires_at = timezone.now() + timedelta(days=days)
    except (ValueError, OverflowError):
        messages.error(request, "Not created: lifetime: enter a whole number of days.")
        return redirect("console-staff-tokens")
    try:
        token, secret = actions.do_create_staff_token(
            request.user, request.POST.get("name", ""), request.POST.get("scope", ""), expires_at
        )
    except ValidationError as error:
        messages.error(request, "Not created: " + _errors_text(error))
        return redirect("console-staff-tokens")
    request.session[NEW_TOKEN_SESSION_KEY] = {"name": token.name, "secret": secret}
    return redirect("console-staff-tokens")


@staff_required
@require_POST
def revoke_staff_token(request: HttpRequest, token_id: int) -> HttpResponse:
    token = actions.access_staff_token(request.user, token_id)
    actions.do_revoke_staff_token(token, request.user)
    messages.info(request, f"Token {token.name} ({token.display}) revoked.")
    return redirect("console-staff-tokens")
