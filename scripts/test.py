"""`make test`: lint, format check, mypy over the tree, the import contracts, bandit, then the
full pytest suite on real PostgreSQL and Redis. `--static-only` (`make lint`) stops before pytest.

Uses the servers named by DATABASE_URL / REDIS_URL, otherwise starts embedded ones under
./var/test/ for the length of the run. Extra arguments go to pytest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from services import ROOT, EmbeddedPostgres, EmbeddedRedis, var_dir, venv_bin


def test_environment(env: dict[str, str]) -> dict[str, str]:
    env.setdefault("SECRET_KEY", "test-only-secret-key-" + "x" * 40)
    env.setdefault("DEBUG", "false")
    # The test client speaks plain HTTP; TLS redirects and secure cookies belong to deployments.
    env.setdefault("SECURE_SSL_REDIRECT", "false")
    env.setdefault("SESSION_COOKIE_SECURE", "false")
    env.setdefault("CSRF_COOKIE_SECURE", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def static_checks() -> list[list[str]]:
    """Lint, format, types over the whole tree, import contracts (.importlinter), then bandit
    at medium severity and above (its scope in pyproject.toml's [tool.bandit]): each must pass
    before the suite runs."""
    return [
        [venv_bin("ruff"), "check", "."],
        [venv_bin("ruff"), "format", "--check", "."],
        [venv_bin("mypy"), "."],
        [venv_bin("lint-imports"), "--no-cache"],
        [venv_bin("bandit"), "-c", "pyproject.toml", "-r", ".", "-ll", "-q"],
    ]


def run_static_checks(env: dict[str, str]) -> bool:
    for step in static_checks():
        print("$", " ".join(step), flush=True)
        if subprocess.run(step, cwd=ROOT, env=env).returncode != 0:
            return False
    return True


def main(argv: list[str]) -> int:
    env = test_environment(dict(os.environ))
    if argv[:1] == ["--static-only"]:  # `make lint`
        return 0 if run_static_checks(env) else 1
    if not run_static_checks(env):
        return 1
    started: list[subprocess.Popen[bytes]] = []
    var = var_dir() / "test"
    try:
        if not env.get("DATABASE_URL"):
            postgres = EmbeddedPostgres(
                var / "postgres", int(env.get("PLATFORM_TEST_PG_PORT", "54339"))
            )
            started.append(postgres.start())
            env["DATABASE_URL"] = postgres.url
        if not env.get("REDIS_URL"):
            redis = EmbeddedRedis(var / "redis", int(env.get("PLATFORM_TEST_REDIS_PORT", "63809")))
            started.append(redis.start())
            env["REDIS_URL"] = redis.url
        pytest = [sys.executable, "-m", "pytest", *argv]
        print("$", " ".join(pytest), flush=True)
        return subprocess.run(pytest, cwd=ROOT, env=env).returncode
    finally:
        for process in started:
            try:
                os.killpg(process.pid, signal.SIGINT)
                process.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                process.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
