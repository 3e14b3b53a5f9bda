"""The Django admin's change and add forms, as a browser would post them back."""

from __future__ import annotations

from typing import Any

from django.test import Client


def admin_form(client: Client, url: str) -> dict[str, Any]:
    """The form at `url` with its fields as the page filled them, the inlines' (and their
    management forms) included, ready to post back."""
    reply = client.get(url)
    form = reply.context["adminform"].form
    values = {name: form[name].value() for name in form.fields}
    for inline in reply.context["inline_admin_formsets"]:
        for each in [inline.formset.management_form, *inline.formset.forms]:
            values.update({each.add_prefix(name): each[name].value() for name in each.fields})
    return {name: "" if value is None else value for name, value in values.items()}
