"""Every command line the agent can write is one vLLM 0.32 takes: the argv builder's output for
GPU and CPU specs (tensor parallel, fp8 and AWQ, fp8 KV cache, LoRA, prefix caching off, the
prefill budget per step the platform chose or left to vLLM),
parsed by vLLM's own argument parser from the installed CPU build, with the values it read.
The GPU-only flags cannot run here; this proves vLLM accepts them as written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from serving.agent.launch import LaunchSettings, build_launch_command
from serving.agent.specs import parse_replica_spec

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
read = []
for argv in json.load(sys.stdin):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    read.append({name: getattr(args, name) for name in (
        "model", "served_model_name", "host", "port", "tensor_parallel_size",
        "gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
        "quantization",
        "kv_cache_dtype", "enable_prefix_caching", "enable_lora", "max_loras", "max_lora_rank")})
    kv = args.kv_transfer_config
    read[-1]["kv_transfer_config"] = None if kv is None else {
        "kv_connector": kv.kv_connector, "kv_role": kv.kv_role,
        "kv_connector_extra_config": kv.kv_connector_extra_config}
print(json.dumps(read))
"""
BASE: dict[str, Any] = {
    "replica_id": "7",
    "deployment_id": "3",
    "model": "hf://meta-llama/Llama-3.1-70B-Instruct",
    "served_model_name": "llama-3.1-70b",
    "gpu_indices": [0, 1],
    "port": 8123,
    "tensor_parallel_size": 2,
    "quantization": "fp8",
    "kv_cache_dtype": "fp8",
    "max_model_len": 16384,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 1024,
    "gpu_memory_utilization": 0.92,
    "enable_prefix_caching": True,
    "enable_lora": True,
    "max_loras": 4,
    "max_lora_rank": 32,
    "api_key": "ek_x",
}
SPECS = [
    BASE,
    {**BASE, "quantization": "awq", "kv_cache_dtype": "auto", "enable_lora": False},
    {
        **BASE,
        "gpu_indices": [3],
        "tensor_parallel_size": 1,
        "quantization": None,
        "enable_prefix_caching": False,
    },
    {
        **BASE,
        "model": "file:///var/models/tiny-llama/base",
        "gpu_indices": [0],
        "tensor_parallel_size": 1,
        "quantization": None,
        "kv_cache_dtype": "auto",
        "max_num_batched_tokens": None,  # a CPU class: vLLM's own
    },
    # Disaggregated phases: a GPU decode replica on NIXL, a CPU prefill replica on shared storage.
    # Neither phase runs decodes beside prompt chunks: both keep vLLM's own budget.
    {
        **BASE,
        "max_num_batched_tokens": None,
        "kv_transfer": {"connector": "NixlConnector", "role": "kv_both"},
    },
    {
        **BASE,
        "model": "file:///var/models/tiny-llama/base",
        "gpu_indices": [0],
        "tensor_parallel_size": 1,
        "quantization": None,
        "kv_cache_dtype": "auto",
        "max_num_batched_tokens": None,
        "kv_transfer": {"connector": "ExampleConnector", "role": "kv_producer"},
    },
]
GPU = LaunchSettings(simulated=False, host="10.0.0.7")
CPU = LaunchSettings(
    simulated=False, device="cpu", host="10.0.0.9", cpu_slots=((0, 1),), kv_shared_dir="/srv/kv"
)


def test_vllm_parses_every_command_line_the_agent_writes_to_the_values_of_the_spec() -> None:
    nodes = [GPU, GPU, GPU, CPU, GPU, CPU]
    launches = [(parse_replica_spec(raw), node) for raw, node in zip(SPECS, nodes, strict=True)]
    argvs = [build_launch_command(spec, node)[0][3:] for spec, node in launches]

    done = subprocess.run(
        [settings.VLLM_PYTHON, "-c", PARSE],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    for (spec, node), values in zip(launches, read, strict=True):
        assert values["served_model_name"] == [spec.served_model_name]
        assert (values["host"], values["port"]) == (node.host, spec.port)
        assert values["tensor_parallel_size"] == spec.tensor_parallel_size
        assert values["gpu_memory_utilization"] == spec.gpu_memory_utilization
        assert (values["max_model_len"], values["max_num_seqs"]) == (
            spec.max_model_len,
            spec.max_num_seqs,
        )
        # Left out (None), vLLM picks its own for the device when it starts.
        assert values["max_num_batched_tokens"] == spec.max_num_batched_tokens
        assert values["quantization"] == spec.quantization
        assert values["kv_cache_dtype"] == spec.kv_cache_dtype
        assert values["enable_prefix_caching"] is spec.enable_prefix_caching
        # Left out, vLLM's default (None: off) stands.
        assert bool(values["enable_lora"]) is spec.enable_lora
        if spec.enable_lora:
            assert (values["max_loras"], values["max_lora_rank"]) == (
                spec.max_loras,
                spec.max_lora_rank,
            )
    assert [values["kv_transfer_config"] for values in read] == [
        None,
        None,
        None,
        None,
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}},
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": "/srv/kv"},
        },
    ]
    assert [values["max_num_batched_tokens"] for values in read] == [1024] * 3 + [None] * 3
    assert read[0]["model"] == "meta-llama/Llama-3.1-70B-Instruct"
    assert read[3]["model"] == "/var/models/tiny-llama/base"
