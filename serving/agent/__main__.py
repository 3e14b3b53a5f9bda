"""`python -m serving.agent --control-plane URL --token JOIN_TOKEN [...]`"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from .agent import AgentConfig, NodeAgent
from .gpus import GpuInventory, NvmlGpus, SimulatedGpus, parse_simulated_gpus
from .replica import Backoff, LaunchSettings, SupervisionTimings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serving.agent", description="GPU node agent: runs and reports replicas."
    )
    parser.add_argument("--control-plane", required=True, help="base URL of the control plane")
    # The environment keeps the join token out of `ps`; systemd passes it that way.
    join_token = os.environ.get("NODE_AGENT_JOIN_TOKEN")
    parser.add_argument(
        "--token",
        required=join_token is None,
        default=join_token,
        help="join token issued by the control plane (or set NODE_AGENT_JOIN_TOKEN)",
    )
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT of the agent's API")
    parser.add_argument("--advertise-url", help="URL the control plane uses to reach this agent")
    parser.add_argument("--node-name", default=socket.gethostname(), help="defaults to hostname")
    parser.add_argument("--state-dir", type=Path, default=Path("var/agent"))
    parser.add_argument(
        "--simulate-gpus", metavar="CLASS:COUNT", help="no NVML: simulate GPUs, e.g. L4-24GB:4"
    )
    parser.add_argument("--sim-time-scale", type=float, default=1.0)
    parser.add_argument("--python", default=sys.executable, help="interpreter for the simulator")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds")
    parser.add_argument("--stop-grace", type=float, default=15.0, help="seconds before SIGKILL")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds")
    parser.add_argument("--restart-backoff-cap", type=float, default=30.0, help="seconds")
    parser.add_argument("--log-level", default="INFO")
    return parser


def _listen_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"--listen wants HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def _inventory(args: argparse.Namespace) -> GpuInventory:
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
        raise SystemExit(f"cannot read GPUs through NVML ({exc}); use --simulate-gpus") from exc


def config_from_args(args: argparse.Namespace, sim_gpu_class: str | None) -> AgentConfig:
    simulated = sim_gpu_class is not None
    host, port = _listen_address(args.listen)
    return AgentConfig(
        control_plane=args.control_plane,
        join_token=args.token,
        state_dir=args.state_dir,
        node_name=args.node_name,
        listen_host=host,
        listen_port=port,
        advertise_url=args.advertise_url,
        launch=LaunchSettings(
            simulated=simulated,
            python=args.python,
            default_time_scale=args.sim_time_scale,
            sim_gpu_class=sim_gpu_class,
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
    gpus = _inventory(args)
    sim_gpu_class = gpus.gpu_class if isinstance(gpus, SimulatedGpus) else None
    agent = NodeAgent(config_from_args(args, sim_gpu_class), gpus)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(agent))


if __name__ == "__main__":
    main()
