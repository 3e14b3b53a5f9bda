"""The KV hand-over of disaggregated serving, as vLLM's NixlConnector (pull mode) does it.

A disaggregated proxy (vLLM's toy_proxy_server.py, llm-d) sends the prefill engine
`kv_transfer_params` with `do_remote_decode: true` and `max_tokens: 1`; that engine answers,
in its non-streamed response, the params NixlConnector's `request_finished` builds
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py): which engine, host,
port and blocks hold the prompt's KV. The proxy hands them to the decode engine, whose
connector loads the whole prompt from there (`do_remote_prefill: true`) instead of computing
it; vLLM still computes the last prompt token, to sample from.

The simulator moves no bytes: the decode engine takes the prompt as loaded at no engine time,
like a prefix-cache hit, and counts it as `external_kv_transfer`. vLLM gates neither side on
`kv_role`, so neither does this. Other connectors (ExampleConnector's shared directory among
them) answer null, as the connector base class does, and are served whole here.
"""

from __future__ import annotations

from typing import Any

from serving.enginesim.config import KvTransferConfig

# The keys NixlConnector needs before it pulls (update_state_after_alloc); without them it
# logs "Got invalid KVTransferParams" and the request is computed locally.
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def loads_remote_prefill(config: KvTransferConfig | None, params: dict[str, Any] | None) -> bool:
    """Whether this engine's connector loads the request's prompt from a prefill engine."""
    if config is None or not config.is_nixl or not params:
        return False
    return bool(
        params.get("do_remote_prefill")
        and params.get("remote_block_ids")
        and all(key in params for key in REMOTE_KEYS)
    )


def hands_off_to_decode(config: KvTransferConfig | None, params: dict[str, Any] | None) -> bool:
    """Whether a finished request answers kv_transfer_params (else null): a prefill-side
    request on a NIXL engine. A decode-side one hands nothing on (vLLM's bidirectional
    transfer is off by default)."""
    if config is None or not config.is_nixl or not params:
        return False
    return bool(params.get("do_remote_decode")) and not params.get("do_remote_prefill")


def prefill_handoff(
    config: KvTransferConfig,
    *,
    request_id: str,
    prompt_tokens: int,
    cached_tokens: int,
    block_ids: list[int],
    tensor_parallel_size: int,
) -> dict[str, Any]:
    """The kv_transfer_params of a prefill that finished (stop or length)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        # One list per KV cache group; a plain attention model has one.
        "remote_block_ids": [block_ids],
        "remote_engine_id": config.engine_id,
        "remote_request_id": request_id,
        "remote_host": config.side_channel_host,
        "remote_port": config.side_channel_port,
        "tp_size": tensor_parallel_size,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens,
        # Set only on a decode engine's bidirectional read-back.
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        # The scheduler adds the prefill side's cache hits, so the decode side can report them.
        "remote_prefill_cached_tokens": cached_tokens,
    }
