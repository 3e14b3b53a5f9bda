"""REST API routes of the serving app, mounted under /api/v1/."""

from django.urls import URLPattern, URLResolver, include, path
from rest_framework.routers import DefaultRouter

from serving.api import views
from serving.api.planner import CapacityPlanView

router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("pools", views.GpuPoolViewSet, basename="pool")
router.register("join-tokens", views.JoinTokenViewSet, basename="join-token")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("gpus", views.GpuViewSet, basename="gpu")
router.register("replicas", views.ReplicaViewSet, basename="replica")

urlpatterns: list[URLPattern | URLResolver] = [
    path("", include(router.urls)),
    path("capacity-plan/", CapacityPlanView.as_view(), name="capacity-plan"),
]
