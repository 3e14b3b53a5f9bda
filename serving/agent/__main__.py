"""`python -m serving.agent --control-plane URL --token-file FILE [...]`

The join token comes from --token-file, NODE_AGENT_JOIN_TOKEN or --token. It is read once at
start-up, and the variable is removed from the agent's environment before any engine starts;
engines get an environment without the agent's secrets (launch.engine_environment)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import MutableMapping
from pathlib import Path
from urllib.parse import urlsplit

from .agent import AgentConfig, NodeAgent
from .gpus import CpuSlots, GpuInventory, NvmlGpus, SimulatedGpus, parse_simulated_gpus
from .launch import ALL_INTERFACES, JOIN_TOKEN_ENV, LaunchSettings
from .replica import Backoff, SupervisionTimings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serving.agent", description="Node agent: runs and reports replicas."
    )
    parser.add_argument("--control-plane", required=True, help="base URL of the control plane")
    # A file or the environment keeps the join token out of `ps` (see join_token()).
    parser.add_argument(
        "--token-file",
        type=Path,
        help=f"file holding the join token (systemd's LoadCredential=), or set {JOIN_TOKEN_ENV}",
    )
    parser.add_argument(
        "--token", help="join token on the command line: visible in `ps`, for development"
    )
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT of the agent's API")
    parser.add_argument("--advertise-url", help="URL the control plane uses to reach this agent")
    parser.add_argument("--node-name", default=socket.gethostname(), help="defaults to hostname")
    parser.add_argument("--state-dir", type=Path, default=Path("var/agent"))
    parser.add_argument(
        "--simulate-gpus", metavar="CLASS:COUNT", help="no NVML: simulate GPUs, e.g. L4-24GB:4"
    )
    parser.add_argument(
        "--cpu-slots",
        type=int,
        metavar="N",
        help="a CPU node: no NVML, run vLLM's CPU build on the cores split into N slots",
    )
    parser.add_argument(
        "--cpu-reserved-cores",
        type=int,
        default=1,
        help="cores of a CPU node kept out of every slot, for the agent and the API servers",
    )
    parser.add_argument(
        "--cpu-kv-cache-gib",
        type=int,
        default=1,
        help="KV cache of each CPU replica, whole GiB (VLLM_CPU_KVCACHE_SPACE takes an integer)",
    )
    parser.add_argument("--sim-time-scale", type=float, default=1.0)
    parser.add_argument("--python", default=sys.executable, help="interpreter for the simulator")
    parser.add_argument(
        "--vllm-python",
        default=sys.executable,
        help="interpreter of the virtual environment vLLM is installed in (default: this one)",
    )
    parser.add_argument(
        "--engine-host",
        help="address engines listen on (default: the agent's own, from --listen or "
        "--advertise-url); never all interfaces",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get("NODE_AGENT_OTLP_TRACES_ENDPOINT") or None,
        help="OTLP/HTTP traces URL vLLM exports its request spans to, e.g. "
        "http://collector:4318/v1/traces (default: NODE_AGENT_OTLP_TRACES_ENDPOINT; unset: "
        "vLLM does not trace)",
    )
    parser.add_argument(
        "--kv-shared-dir",
        type=Path,
        default=None,
        help="where disaggregated replicas on the shared-storage connector hand KV over: a "
        "directory every node of both phases' pools mounts at this path (default: "
        "STATE_DIR/kv, which only replicas of this node share)",
    )
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds")
    parser.add_argument("--stop-grace", type=float, default=15.0, help="seconds before SIGKILL")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds")
    parser.add_argument("--restart-backoff-cap", type=float, default=30.0, help="seconds")
    parser.add_argument("--log-level", default="INFO")
    return parser


def join_token(args: argparse.Namespace, environ: MutableMapping[str, str]) -> str:
    """The join token from --token-file, --token or the environment, in that order. The
    variable leaves `environ` whichever is used: nothing the agent starts inherits it."""
    from_env = environ.pop(JOIN_TOKEN_ENV, None)
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise SystemExit(f"--token-file: cannot read {args.token_file}: {exc}") from exc
        if not token:
            raise SystemExit(f"--token-file: {args.token_file} is empty")
        return str(token)
    token = args.token or from_env
    if not token:
        raise SystemExit(f"a join token is needed: --token-file, {JOIN_TOKEN_ENV} or --token")
    return str(token)


def _listen_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"--listen wants HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def _inventory(args: argparse.Namespace) -> GpuInventory:
    if args.simulate_gpus and args.cpu_slots:
        raise SystemExit("--simulate-gpus and --cpu-slots exclude each other")
    if args.cpu_slots:
        if args.cpu_kv_cache_gib < 1:
            raise SystemExit("--cpu-kv-cache-gib must be at least 1")
        try:
            return CpuSlots(args.cpu_slots, args.node_name, reserved=args.cpu_reserved_cores)
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
    if args.simulate_gpus:
        try:
            gpu_class, count = parse_simulated_gpus(args.simulate_gpus)
            # The state directory tells apart simulated nodes that share one host's name.
            identity = f"{args.node_name}:{args.state_dir.resolve()}"
            return SimulatedGpus(gpu_class, count, identity)
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
    try:
        return NvmlGpus()
    except Exception as exc:  # pynvml raises its own NVMLError family, or ImportError
        raise SystemExit(
            f"cannot read GPUs through NVML ({exc}); use --cpu-slots or --simulate-gpus"
        ) from exc


def engine_host(args: argparse.Namespace, listen_host: str) -> str:
    """Where engines listen: the node's own address, the one the control plane knows it by."""
    if args.engine_host:
        host = str(args.engine_host)
    elif listen_host not in ALL_INTERFACES:
        host = listen_host
    else:
        host = urlsplit(args.advertise_url or "").hostname or ""
    if host in ALL_INTERFACES:
        raise SystemExit(
            "engines must listen on the node's address, not on all interfaces: "
            "set --engine-host (or --advertise-url, or a specific --listen host)"
        )
    return host


def config_from_args(
    args: argparse.Namespace, gpus: GpuInventory, token: str | None = None
) -> AgentConfig:
    sim_gpu_class = gpus.gpu_class if isinstance(gpus, SimulatedGpus) else None
    host, port = _listen_address(args.listen)
    return AgentConfig(
        control_plane=args.control_plane,
        join_token=token if token is not None else str(args.token or ""),
        state_dir=args.state_dir,
        node_name=args.node_name,
        listen_host=host,
        listen_port=port,
        advertise_url=args.advertise_url,
        launch=LaunchSettings(
            simulated=gpus.simulated,
            device="cpu" if isinstance(gpus, CpuSlots) else "gpu",
            python=args.python,
            vllm_python=args.vllm_python,
            default_time_scale=args.sim_time_scale,
            sim_gpu_class=sim_gpu_class,
            host=engine_host(args, host),
            cpu_slots=gpus.slots if isinstance(gpus, CpuSlots) else (),
            cpu_kv_cache_gib=args.cpu_kv_cache_gib,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            kv_shared_dir=str((args.kv_shared_dir or args.state_dir / "kv").resolve()),
        ),
        timings=SupervisionTimings(
            backoff=Backoff(cap_s=args.restart_backoff_cap),
            ready_timeout_s=args.ready_timeout,
            stop_grace_s=args.stop_grace,
            drain_timeout_s=args.drain_timeout,
        ),
    )


async def serve(agent: NodeAgent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await agent.start()
    logging.getLogger(__name__).info("agent API on %s", agent.agent_url)
    try:
        await stop.wait()
    finally:
        await agent.stop()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    token = join_token(args, os.environ)
    gpus = _inventory(args)
    agent = NodeAgent(config_from_args(args, gpus, token), gpus)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(agent))


if __name__ == "__main__":
    main()
