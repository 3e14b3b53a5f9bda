"""Micro-benchmark of the engine model: simulated seconds per CPU second.

Replays a Poisson stream with the Azure 2023 conversation trace's rate and its empirical prompt
and output lengths (sampled from the trace) for one hour, over 1 and 64 engines (llama-3.1-8b
bf16 on H100). "touch all" advances every engine at every arrival, as a cluster simulator that
reads every engine's telemetry before routing would.

    .venv/bin/python bench/engine_core.py [--hours 1.0] [--gpu H100-SXM-80GB]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.clustersim.workloads import AZURE_CONV_CSV, read_azure
from serving.engine.core import Engine, EngineRequest
from serving.engine.perf import PerfModel
from serving.engine.specs import load_gpu_specs, load_model_specs

TRACE_RATE_PER_S = 19366 / 3502.0  # requests over the trace's span
MAX_MODEL_LEN = 16384


def trace_lengths() -> list[tuple[int, int]]:
    return [(row.prompt_tokens, max(1, row.output_tokens)) for row in read_azure(AZURE_CONV_CSV)]


def poisson_stream(hours: float, rate: float, seed: int = 7) -> list[EngineRequest]:
    rng = random.Random(seed)
    lengths = trace_lengths()
    requests: list[EngineRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= hours * 3600:
            return requests
        prompt, output = rng.choice(lengths)
        output = min(output, MAX_MODEL_LEN - prompt)
        requests.append(EngineRequest(f"r{len(requests)}", prompt, output, t))


def replay(engines: list[Engine], requests: list[EngineRequest], touch_all: bool) -> float:
    started = time.process_time()
    for i, req in enumerate(requests):
        if touch_all:
            for engine in engines:
                engine.advance(req.arrival_s)
        target = engines[i % len(engines)]
        target.advance(req.arrival_s)
        target.add_request(req)
    for engine in engines:
        engine.advance(math.inf)
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--gpu", default="H100-SXM-80GB")
    args = parser.parse_args()
    perf = PerfModel(load_gpu_specs()[args.gpu], load_model_specs()["llama-3.1-8b"])
    rows = [
        ("1 engine, 1/64 of the trace rate", 1, TRACE_RATE_PER_S / 64, False),
        ("1 engine, the full trace rate", 1, TRACE_RATE_PER_S, False),
        ("64 engines, the full trace rate", 64, TRACE_RATE_PER_S, False),
        ("64 engines, full rate, touch all", 64, TRACE_RATE_PER_S, True),
    ]
    print(f"{'workload':<36} {'requests':>9} {'tokens out':>11} {'CPU s':>7} {'sim s / CPU s':>14}")
    for label, count, rate, touch_all in rows:
        requests = poisson_stream(args.hours, rate)
        engines = [Engine(perf, max_model_len=MAX_MODEL_LEN) for _ in range(count)]
        cpu = replay(engines, requests, touch_all)
        simulated = max(args.hours * 3600, max(e.clock_s for e in engines))
        tokens = sum(e.generation_tokens_total for e in engines)
        print(f"{label:<36} {len(requests):>9} {tokens:>11} {cpu:>7.2f} {simulated / cpu:>14.0f}")


if __name__ == "__main__":
    main()
