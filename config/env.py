"""Typed readers for settings that come from environment variables.

Each helper stops start-up with a message that names the variable when its value is bad,
in the manner of healthchecks' `envbool` / `envint`.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse


class ImproperEnvironment(SystemExit):
    """Raised at start-up when an environment variable holds a value we cannot use."""

    def __init__(self, name: str, value: str, expected: str) -> None:
        super().__init__(f"Bad environment variable {name}={value!r}: expected {expected}.")


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperEnvironment(name, raw, "one of true/false/1/0/yes/no/on/off")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperEnvironment(name, raw, "an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperEnvironment(name, raw, f"an integer of at least {minimum}")
    return value


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperEnvironment(name, raw, "a number") from None


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_url(name: str, default: str, *, schemes: set[str]) -> str:
    raw = os.environ.get(name) or default
    parsed = urlparse(raw)
    if parsed.scheme not in schemes or not (parsed.hostname or parsed.path or parsed.query):
        raise ImproperEnvironment(name, raw, f"a URL with scheme {' or '.join(sorted(schemes))}")
    return raw
