"""A file:// artifact lies inside PLATFORM_MODEL_ROOT: any other path, relative, dotted,
encoded or behind a symlink, is refused at registration with a 400 that says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core.exceptions import ValidationError
from pytest_django import Settings

from registry.actions import do_create_adapter, do_create_version
from registry.models import Model, ModelVersion, check_artifact_file_uri
from tests.registry.conftest import approved_version, client_for

REFUSAL = (
    "A file:// artifact must be a directory inside the platform's model root (PLATFORM_MODEL_ROOT)."
)


@pytest.fixture
def root(tmp_path: Path, settings: Settings) -> Path:
    models = tmp_path / "models"
    (models / "llama" / "base").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    settings.PLATFORM_MODEL_ROOT = models
    return models


def refused_uris(root: Path) -> list[str]:
    (root / "escape").symlink_to(root.parent / "elsewhere")
    return [
        "file:///etc/passwd",
        "file://../..",
        "file://../../etc/passwd",
        f"file://node-7{root}/llama",  # a host part: not a path on this machine
        f"file://{root.parent}/elsewhere",
        f"file://{root}/../elsewhere",
        f"file://{root}/llama/%2e%2e/%2e%2e/elsewhere",  # the engine percent-decodes
        f"file://{root}/escape/weights",  # a symlink out of the root
        f"file://{root}",  # the root itself is not an artifact
        f"file://{root}/llama%00/base",
    ]


def test_every_path_out_of_the_model_root_is_refused(root: Path) -> None:
    for uri in refused_uris(root):
        with pytest.raises(ValidationError, match="PLATFORM_MODEL_ROOT"):
            check_artifact_file_uri(uri)


def test_paths_inside_the_root_and_other_schemes_pass(root: Path) -> None:
    (root / "current").symlink_to(root / "llama")  # a symlink that stays inside
    for uri in (
        f"file://{root}/llama/base",
        f"file://{root}/not-built-yet/base",
        f"file://{root}/current/base",
        "hf://meta-llama/Llama-3.1-8B-Instruct",
        "s3://bucket/llama/",
    ):
        check_artifact_file_uri(uri)


def test_a_version_outside_the_root_is_not_registered(root: Path, llama_8b: Model) -> None:
    with pytest.raises(ValidationError) as refused:
        do_create_version(llama_8b, version="v9", artifact_uri="file:///etc/passwd")
    assert refused.value.message_dict == {"artifact_uri": [REFUSAL]}
    assert not ModelVersion.objects.filter(version="v9").exists()


def test_an_adapter_behind_a_symlink_out_of_the_root_is_not_registered(
    root: Path, llama_8b: Model
) -> None:
    (root / "escape").symlink_to(root.parent / "elsewhere")
    base = approved_version(llama_8b, "v1", "bf16")
    with pytest.raises(ValidationError) as refused:
        do_create_adapter(
            name="sneaky", base_version=base, rank=8, artifact_uri=f"file://{root}/escape/lora"
        )
    assert refused.value.message_dict == {"artifact_uri": [REFUSAL]}


@pytest.mark.parametrize("uri", ["file:///etc/passwd", "file://../.."])
def test_registering_a_version_outside_the_root_over_the_api_is_a_400(
    root: Path, staff: Any, llama_8b: Model, uri: str
) -> None:
    response = client_for(staff).post(
        "/api/v1/versions/",
        {"model": llama_8b.pk, "version": "v9", "artifact_uri": uri},
        format="json",
    )
    assert response.status_code == 400
    assert "artifact_uri" in response.json()
    assert not ModelVersion.objects.filter(version="v9").exists()


def test_an_adapter_outside_the_root_over_the_api_is_a_400_that_says_why(
    root: Path, staff: Any, llama_8b: Model
) -> None:
    base = approved_version(llama_8b, "v1", "bf16")
    response = client_for(staff).post(
        "/api/v1/adapters/",
        {"name": "sneaky", "base_version": base.pk, "rank": 8, "artifact_uri": "file:///etc"},
        format="json",
    )
    assert response.status_code == 400
    assert response.json() == {"artifact_uri": [REFUSAL]}


def test_the_model_root_is_the_var_models_directory_unless_set() -> None:
    # The demo's tiny model is built in PLATFORM_VAR_DIR/models/tiny-llama (scripts/run.py).
    assert Path(django_settings.PLATFORM_MODEL_ROOT) == django_settings.PLATFORM_VAR_DIR / "models"
