"""A disaggregated pair of real vLLM CPU engines, launched from the specs the control plane
writes for a shared-storage deployment (kv_producer prefill, kv_consumer decode) through the
agent's argv builder: a prompt prefilled on one is decoded on the other from the KV it left.

Its own package: the real_vllm package's fleet (one engine on this 2-core machine) is torn down
before this starts, so the pair has the machine's two cores, one each."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings

from serving.agent.launch import LaunchSettings, build_launch_command, engine_environment
from serving.agent.specs import parse_replica_spec
from serving.demo import TINY_MODEL
from tests.gateway.conftest import free_port, sample
from tests.live import eventually

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "var" / "test" / "models" / "tiny-llama"
BLOCK = 128  # the CPU backend's KV block, in tokens (REAL_VLLM.md)
READY_TIMEOUT_S = 420
EXTERNAL = {"source": "external_kv_transfer"}


@dataclass
class Phase:
    url: str
    key: str
    process: subprocess.Popen[bytes]

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        reply = httpx.post(
            f"{self.url}/v1/completions",
            json={"model": TINY_MODEL, "prompt": prompt, "max_tokens": max_tokens},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        return answer

    def metric(self, name: str, **labels: str) -> float:
        return sample(httpx.get(f"{self.url}/metrics", timeout=30).text, name, **labels)


def _spec(replica_id: str, slot: int, role: str) -> dict[str, Any]:
    """What reconcile's replica_spec writes for one phase of a shared-storage deployment."""
    return {
        "replica_id": replica_id,
        "deployment_id": "1",
        "model": (MODEL_DIR / "base").resolve().as_uri(),
        "served_model_name": TINY_MODEL,
        "gpu_indices": [slot],
        "port": free_port(),
        "tensor_parallel_size": 1,
        "max_model_len": 4096,
        "max_num_seqs": 8,
        "api_key": f"ek_test_{replica_id}",
        "kv_transfer": {"connector": "ExampleConnector", "role": role},
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Phase, Phase]]:
    python = Path(settings.VLLM_PYTHON)
    if not python.exists():
        pytest.fail(f"vLLM's CPU build is not installed ({python} is missing)")
    subprocess.run(
        [str(python), "scripts/build_tiny_model.py", str(MODEL_DIR)],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    shared = tmp_path_factory.mktemp("kv")
    logs = tmp_path_factory.mktemp("engines")
    node = LaunchSettings(
        simulated=False,
        device="cpu",
        vllm_python=str(python),
        cpu_slots=((0,), (1,)),
        kv_shared_dir=str(shared),
    )
    phases = []
    try:
        for replica_id, slot, role in (("1", 0, "kv_producer"), ("2", 1, "kv_consumer")):
            spec = parse_replica_spec(_spec(replica_id, slot, role))
            argv, extra = build_launch_command(spec, node)
            with (logs / f"{role}.log").open("wb") as out:
                process = subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=engine_environment(os.environ, extra),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            assert spec.api_key is not None
            phases.append(Phase(f"http://127.0.0.1:{spec.port}", spec.api_key, process))
        for phase, role in zip(phases, ("kv_producer", "kv_consumer"), strict=True):
            try:
                eventually(partial(_healthy, phase), READY_TIMEOUT_S, f"{role} up", step_s=2)
            except AssertionError:
                tail = (logs / f"{role}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"{role} did not come up:\n{tail}") from None
        yield phases[0], phases[1]
    finally:
        # Each engine leads its own process group (its engine core is a child): the whole
        # group goes, so no busy-polling engine core outlives the test.
        for phase in phases:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(phase.process.pid, signal.SIGTERM)
        for phase in phases:
            with contextlib.suppress(subprocess.TimeoutExpired):
                phase.process.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(phase.process.pid, signal.SIGKILL)


def _healthy(phase: Phase) -> bool:
    if phase.process.poll() is not None:
        raise AssertionError(f"the engine exited with {phase.process.returncode}")
    try:
        return httpx.get(f"{phase.url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_disaggregated_decode_reads_the_whole_blocks_the_prefill_left(
    pair: tuple[Phase, Phase],
) -> None:
    prefill, decode = pair
    prompt = " ".join(f"clause {i} of the hand-over test says nothing new." for i in range(30))
    before = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL)
    first = prefill.complete(prompt, max_tokens=1)
    prompt_tokens = int(first["usage"]["prompt_tokens"])
    assert prompt_tokens > BLOCK  # at least one whole block to hand over
    answer = decode.complete(prompt, max_tokens=4)
    assert answer["usage"]["prompt_tokens"] == prompt_tokens
    assert answer["usage"]["completion_tokens"] >= 1
    handed = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL) - before
    # The consumer loaded every whole block from the producer's KV and computed the rest.
    assert handed == (prompt_tokens // BLOCK) * BLOCK
    computed = decode.metric("vllm:prompt_tokens_by_source_total", source="local_compute")
    assert computed >= prompt_tokens - handed
    # A prompt the producer never saw has nothing to load.
    other = decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL)
    decode.complete("A different prompt entirely, " * 40, max_tokens=1)
    assert decode.metric("vllm:prompt_tokens_by_source_total", **EXTERNAL) == other
