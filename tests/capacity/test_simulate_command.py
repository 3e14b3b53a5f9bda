"""`manage.py simulate` takes the simulator CLI's flags."""

from __future__ import annotations

import pytest
from django.core.management import call_command


def test_manage_py_simulate_runs_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    call_command(
        "simulate",
        "--workload",
        "poisson",
        "--rate",
        "2",
        "--duration",
        "10",
        "--fleet",
        "L40S-48GB:1",
        "--policy",
        "least_load",
    )
    assert "least_load on 1x L40S-48GB" in capsys.readouterr().out
