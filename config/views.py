"""The landing page (staff go to the admin console, tenant members to their portal) and the
decorator every console page uses."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from tenants.actions import tenants_for_user

View = Callable[..., HttpResponse]


def staff_required(view: View) -> View:
    """Logged in (else to the login page) and platform staff (else 403)."""

    @login_required
    @wraps(view)
    def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_staff:
            raise PermissionDenied("The admin console is for platform staff.")
        return view(request, *args, **kwargs)

    return checked


@login_required
def home(request: HttpRequest) -> HttpResponse:
    if request.user.is_staff:
        return redirect("console-overview")
    tenants = list(tenants_for_user(request.user))
    if len(tenants) == 1:
        return redirect("portal-keys", slug=tenants[0].slug)
    return render(request, "home.html", {"tenants": tenants})
