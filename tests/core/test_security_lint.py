"""Bandit in `make test`: a static step after the import contracts, over the project's code at
medium severity and above, and the tree passes it."""

from __future__ import annotations

import importlib.util
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# scripts/test.py, what `make test` runs, loaded by path: `import test` is the stdlib's.
_spec = importlib.util.spec_from_file_location("make_test", ROOT / "scripts" / "test.py")
assert _spec is not None and _spec.loader is not None
make_test = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_test)


def _step_names() -> list[str]:
    return [Path(step[0]).name for step in make_test.static_checks()]


def test_bandit_runs_after_the_import_contracts_and_before_pytest() -> None:
    names = _step_names()
    assert names.index("bandit") == names.index("lint-imports") + 1
    bandit = make_test.static_checks()[names.index("bandit")]
    assert bandit[1:3] == ["-c", "pyproject.toml"] and "-ll" in bandit


def test_bandit_scans_the_code_and_leaves_tests_and_environments_out() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["bandit"]
    excluded = set(config["exclude_dirs"])
    assert {"tests", ".venv", "var"} <= excluded
    assert not excluded & {"serving", "config", "tenants", "metering", "registry", "scripts"}


@pytest.mark.slow
def test_the_project_passes_bandit_at_medium_severity() -> None:
    names = _step_names()
    bandit = make_test.static_checks()[names.index("bandit")]
    result = subprocess.run(bandit, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
