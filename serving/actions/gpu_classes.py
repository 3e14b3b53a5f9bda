"""Keep the GpuClass table in step with the datasheet CSVs shipped with the engine model.

A pool's class is a GPU (gpus.csv) or a CPU slot (cpus.csv: a group of cores running vLLM's
CPU build). CPU classes are kept out of the engine model's GPU list, so the roofline, the
placement suggestions and the capacity planner never offer a CPU slot for a GPU's work."""

from __future__ import annotations

import csv
from decimal import Decimal
from pathlib import Path
from typing import Any

from serving.engine.specs import DATA_DIR

GPUS_CSV = DATA_DIR / "gpus.csv"
CPUS_CSV = DATA_DIR / "cpus.csv"


def read_gpu_rows(path: Path = GPUS_CSV) -> list[dict[str, Any]]:
    with path.open(newline="") as handle:
        return [
            {
                "name": row["gpu"],
                "memory_gb": float(row["memory_gb"]),
                "mem_bandwidth_gbs": float(row["mem_bandwidth_gbs"]),
                "bf16_tflops": float(row["bf16_dense_tflops"]),
                "fp8_tflops": float(row["fp8_dense_tflops"]) if row["fp8_dense_tflops"] else None,
                "tdp_w": int(row["tdp_w"]),
                "default_usd_per_hour": Decimal(row["usd_per_hour"]),
                "notes": row["notes"],
            }
            for row in csv.DictReader(handle)
        ]


def sync_gpu_classes(gpu_class_model: Any) -> int:
    """Create or update one row per GPU and CPU class; works with historical models too."""
    rows = read_gpu_rows(GPUS_CSV) + read_gpu_rows(CPUS_CSV)
    for row in rows:
        name = row.pop("name")
        gpu_class_model.objects.update_or_create(name=name, defaults=row)
    return len(rows)
