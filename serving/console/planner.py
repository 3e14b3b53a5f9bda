"""The console's capacity calculator: a form that htmx posts back here for the plan."""

from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from serving.api.serializers import PlanRequestSerializer
from serving.capacity.planner import plan_for

DEFAULTS = {
    "users": 10_000,
    "requests_per_user_s": 0.1,
    "prompt_tokens": 1000,
    "output_tokens": 500,
    "ttft_slo_s": 1.0,
    "tpot_slo_s": 0.05,
    "tokens_per_s_per_gpu": 4500,
}


@staff_member_required
def capacity_planner(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        serializer = PlanRequestSerializer()
        return render(
            request,
            "serving/planner.html",
            {"values": DEFAULTS, "models": serializer.fields["model"].choices},
        )
    form = PlanRequestSerializer(data={k: v for k, v in request.POST.items() if v != ""})
    if not form.is_valid():
        return render(request, "serving/planner_result.html", {"errors": form.errors}, status=400)
    plan = plan_for(form.validated_data)
    return render(request, "serving/planner_result.html", {"plan": plan})
