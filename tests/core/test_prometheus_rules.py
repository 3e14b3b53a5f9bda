"""The alert rules load in real Prometheus and fire, and stay quiet, as their tests say.

promtool (Debian's prometheus package; .ci/run installs it) checks alerts.yaml and runs the
rule unit tests in platform/prometheus/*test*.yml. A missing promtool fails these tests
rather than skipping them: a skipped check would let a broken rule through unnoticed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "platform" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yaml"


def rule_test_files() -> list[Path]:
    return sorted(PROMETHEUS.glob("*test*.yml"))


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, (
        "promtool is not installed: install Debian's prometheus package "
        "(apt-get install prometheus), which provides /usr/bin/promtool"
    )
    return subprocess.run(
        [binary, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120
    )


def promtool_output(result: subprocess.CompletedProcess[str]) -> str:
    return f"promtool exited {result.returncode}\n{result.stdout}\n{result.stderr}"


def alert_names() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def alerts_tested_firing() -> set[str]:
    """Names of the alerts some test case expects to fire (a non-empty exp_alerts)."""
    tested: set[str] = set()
    for path in rule_test_files():
        suite: dict[str, Any] = yaml.safe_load(path.read_text())
        for test in suite.get("tests", []):
            for case in test.get("alert_rule_test", []):
                if case.get("exp_alerts"):
                    tested.add(case["alertname"])
    return tested


def test_promtool_accepts_the_alert_rules() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, promtool_output(result)


def test_the_rule_unit_tests_pass_in_promtool() -> None:
    files = rule_test_files()
    assert files, f"no rule test file (*test*.yml) in {PROMETHEUS}"
    result = promtool("test", "rules", *(str(path) for path in files))
    assert result.returncode == 0, promtool_output(result)


def test_every_alert_has_a_test_case_where_it_fires() -> None:
    names = alert_names()
    assert names
    untested = sorted(set(names) - alerts_tested_firing())
    assert not untested, f"no rule test expects these alerts to fire: {untested}"


def test_every_rule_test_file_loads_the_alert_rules() -> None:
    for path in rule_test_files():
        suite = yaml.safe_load(path.read_text())
        assert ALERTS.name in suite["rule_files"], f"{path.name} does not load {ALERTS.name}"
