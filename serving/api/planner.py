"""The capacity planner over REST: POST a workload and its SLO, get GPUs per pool.

Staff only: the answer prices the fleet's own pools. Without `pools` in the body the planner
uses the GPU pools in the database (their prices; `available_gpus` unbounded), or the GPU
classes at reference prices when no pool exists yet.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from serving.api.serializers import PlanRequestSerializer
from serving.capacity.planner import CapacityPlan, plan_for


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
        return Response(plan_json(plan_for(serializer.validated_data)))
