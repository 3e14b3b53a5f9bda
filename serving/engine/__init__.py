"""The engine model: one vLLM engine as plain Python, shared by the engine simulator and the
cluster simulator. Imports nothing from Django."""

from serving.engine.core import Engine, EngineEvent, EngineRequest, StepResult
from serving.engine.perf import PerfModel
from serving.engine.placement import PlacementResult, check_placement, suggest_placements
from serving.engine.specs import (
    GpuSpec,
    ModelSpec,
    load_gpu_specs,
    load_model_specs,
    normalize_quantization,
)
from serving.engine.tokens import estimate_prompt_tokens

__all__ = [
    "Engine",
    "EngineEvent",
    "EngineRequest",
    "GpuSpec",
    "ModelSpec",
    "PerfModel",
    "PlacementResult",
    "StepResult",
    "check_placement",
    "estimate_prompt_tokens",
    "load_gpu_specs",
    "load_model_specs",
    "normalize_quantization",
    "suggest_placements",
]
