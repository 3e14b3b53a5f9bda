"""The vLLM demo's tiny model, where `make run` builds it, passes the model-root check."""

from __future__ import annotations

import pytest
from django.conf import settings

from registry.models import Adapter, ModelVersion
from serving import demo
from serving.models import GpuClass, GpuPool

pytestmark = pytest.mark.django_db


def test_the_tiny_model_built_under_var_models_registers_inside_the_model_root(
    gpu_classes: None,
) -> None:
    GpuPool.objects.create(
        name="cpu-local", gpu_class=GpuClass.objects.get(name="CPU-X86-2C"), region="local"
    )
    demo.seed_tiny_model(demo.tiny_model_dir(), "cpu-local")
    version = ModelVersion.objects.get(model__name=demo.TINY_MODEL)
    adapter = Adapter.objects.get(name=demo.TINY_ADAPTER)
    root = settings.PLATFORM_MODEL_ROOT.as_uri()
    assert version.artifact_uri.startswith(root + "/")
    assert adapter.artifact_uri.startswith(root + "/")
