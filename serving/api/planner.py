"""The capacity planner over REST: POST a workload and its SLO, get GPUs per pool.

Staff only: the answer prices the fleet's own pools. Without `pools` in the body the planner
uses the GPU pools in the database (their prices; `available_gpus` unbounded), or the GPU
classes at reference prices when no pool exists yet.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from serving.engine.specs import QUANTIZATIONS, load_gpu_specs, load_model_specs
from serving.models import GpuPool
from serving.planner import (
    CapacityPlan,
    PoolOption,
    Workload,
    default_pools,
    plan_capacity,
    textbook_estimate,
)


class PoolOptionSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64)
    gpu_class = serializers.ChoiceField(choices=[])
    usd_per_gpu_hour = serializers.FloatField(min_value=0, required=False, allow_null=True)
    available_gpus = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    tensor_parallel = serializers.ChoiceField(choices=[1, 2, 4, 8], default=1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["gpu_class"].choices = sorted(load_gpu_specs())


class PlanRequestSerializer(serializers.Serializer):
    users = serializers.IntegerField(min_value=1, max_value=1_000_000_000)
    requests_per_user_s = serializers.FloatField(min_value=0.000001, max_value=1000)
    prompt_tokens = serializers.IntegerField(min_value=1, max_value=1_000_000)
    output_tokens = serializers.IntegerField(min_value=1, max_value=1_000_000)
    ttft_slo_s = serializers.FloatField(
        min_value=0.001, required=False, allow_null=True, default=1.0
    )
    tpot_slo_s = serializers.FloatField(
        min_value=0.001, required=False, allow_null=True, default=0.05
    )
    model = serializers.ChoiceField(choices=[], default="llama-3.1-8b")
    quantization = serializers.ChoiceField(choices=list(QUANTIZATIONS), default="bf16")
    # The textbook estimate alongside, when a measured per-GPU throughput is given.
    tokens_per_s_per_gpu = serializers.FloatField(min_value=0.001, required=False)
    pools = PoolOptionSerializer(many=True, required=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = sorted(load_model_specs())


def fleet_pools() -> list[PoolOption]:
    rows = GpuPool.objects.select_related("gpu_class").order_by("name")
    pools = [
        PoolOption(row.name, row.gpu_class.name, float(row.price_per_gpu_hour)) for row in rows
    ]
    return pools or default_pools()


def plan_from(data: dict[str, Any]) -> CapacityPlan:
    workload = Workload(
        users=data["users"],
        requests_per_user_s=data["requests_per_user_s"],
        prompt_tokens=data["prompt_tokens"],
        output_tokens=data["output_tokens"],
        ttft_slo_s=data.get("ttft_slo_s"),
        tpot_slo_s=data.get("tpot_slo_s"),
        model=data.get("model", "llama-3.1-8b"),
        quantization=data.get("quantization", "bf16"),
    )
    pools = [PoolOption(**pool) for pool in data["pools"]] if data.get("pools") else fleet_pools()
    plan = plan_capacity(workload, pools)
    if data.get("tokens_per_s_per_gpu"):
        textbook = textbook_estimate(
            workload.users,
            workload.requests_per_user_s,
            workload.output_tokens,
            data["tokens_per_s_per_gpu"],
        )
        plan = CapacityPlan(**{**plan_fields(plan), "textbook": textbook})
    return plan


def plan_fields(plan: CapacityPlan) -> dict[str, Any]:
    return {name: getattr(plan, name) for name in plan.__dataclass_fields__}


def plan_json(plan: CapacityPlan) -> dict[str, Any]:
    return {
        "demand_output_tokens_per_s": plan.demand_tokens_per_s,
        "headroom_factor": plan.headroom_factor,
        "gpus": plan.gpus,
        "usd_per_hour": round(plan.usd_per_hour, 4),
        "meets_demand": plan.meets_demand,
        "unmet_output_tokens_per_s": plan.unmet_tokens_per_s,
        "pools": [asdict(line) for line in plan.lines],
        "infeasible": plan.infeasible,
        "textbook": asdict(plan.textbook) if plan.textbook else None,
    }


class CapacityPlanView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(request=PlanRequestSerializer, responses=dict)
    def post(self, request: Request) -> Response:
        serializer = PlanRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        return Response(plan_json(plan_from(serializer.validated_data)))
