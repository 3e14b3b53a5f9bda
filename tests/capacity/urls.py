"""The planner's routes as the project will mount them (config/urls.py is not ours to edit)."""

from django.urls import include, path

from serving.api.planner import CapacityPlanView
from serving.console.planner import capacity_planner

urlpatterns = [
    path("", include("config.urls")),
    path("test-api/capacity-plan/", CapacityPlanView.as_view(), name="capacity-plan"),
    path("test-console/capacity/", capacity_planner, name="capacity-planner"),
]
