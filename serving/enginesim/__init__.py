"""The engine simulator: an aiohttp server that speaks vLLM's OpenAI-compatible interface and
generates filler text at the speed the engine model predicts. Imports nothing from Django."""

from serving.enginesim.config import SimConfig, parse_args
from serving.enginesim.server import build_app

__all__ = ["SimConfig", "build_app", "parse_args"]
