"""Keep the GpuClass table in step with the datasheet CSV shipped with the engine model."""

from __future__ import annotations

import csv
from decimal import Decimal
from pathlib import Path
from typing import Any

GPUS_CSV = Path(__file__).resolve().parent / "engine" / "data" / "gpus.csv"


def read_gpu_rows() -> list[dict[str, Any]]:
    with GPUS_CSV.open(newline="") as handle:
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
    """Create or update one row per GPU in the CSV; works with historical models too."""
    rows = read_gpu_rows()
    for row in rows:
        name = row.pop("name")
        gpu_class_model.objects.update_or_create(name=name, defaults=row)
    return len(rows)
