from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_platform_folder_is_not_a_python_package() -> None:
    assert (ROOT / "platform").is_dir()
    assert not list((ROOT / "platform").rglob("*.py"))


def test_import_platform_gives_the_standard_library_module_from_the_project_root() -> None:
    # Run from the project root, where a platform/__init__.py would shadow the stdlib module.
    code = (
        "import django, platform, uuid, celery, kombu, redis;"
        "django.setup();"
        "print(platform.__file__); print(platform.python_implementation())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"DJANGO_SETTINGS_MODULE": "config.settings", "DEBUG": "true", "PATH": "/usr/bin"},
        check=True,
    )
    module_file, implementation = result.stdout.split()
    assert Path(module_file).parent == Path(sysconfig.get_paths()["stdlib"])
    assert implementation == "CPython"
