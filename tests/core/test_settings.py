from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    unset = {"SECRET_KEY", "DEBUG", "DJANGO_ALLOW_ASYNC_UNSAFE"}
    base = {k: v for k, v in os.environ.items() if k not in unset}
    for name in ("SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE"):
        base.pop(name, None)
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_reports_nothing_with_debug_off() -> None:
    result = run_manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        SECRET_KEY="kq3-Zp9v!xR2mW8t#Lc5yB7nD0fH4jG6sA1eU" * 2,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_it_refuses_to_start_without_a_secret_key_when_debug_is_off() -> None:
    result = run_manage("check")
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_boolean_names_the_variable() -> None:
    result = run_manage("check", DEBUG="maybe")
    assert result.returncode != 0
    assert "Bad environment variable DEBUG='maybe'" in result.stderr


def test_a_bad_database_url_names_the_variable() -> None:
    result = run_manage("check", DEBUG="true", DATABASE_URL="mysql://nope")
    assert result.returncode != 0
    assert "DATABASE_URL" in result.stderr


def test_a_bad_deferral_share_names_the_variable() -> None:
    for value in ("soon", "0", "-1"):
        result = run_manage("check", DEBUG="true", GATEWAY_DEFER_LOOSER_AFTER=value)
        assert result.returncode != 0
        assert f"Bad environment variable GATEWAY_DEFER_LOOSER_AFTER={value!r}" in result.stderr
    assert run_manage("check", DEBUG="true", GATEWAY_DEFER_LOOSER_AFTER="0.5").returncode == 0


def test_the_deferral_share_reaches_the_gateways_router() -> None:
    code = (
        "import django; django.setup(); from config.gateway import gateway_config; "
        "print(gateway_config().defer_looser_after)"
    )
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_DEFER_LOOSER_AFTER"}
    for value, shown in (("0.5", "0.5"), ("", "None")):
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={
                **env,
                "DJANGO_SETTINGS_MODULE": "config.settings",
                "DEBUG": "true",
                "GATEWAY_DEFER_LOOSER_AFTER": value,
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.stdout.strip() == shown, result.stderr
