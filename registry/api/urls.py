"""REST API routes of the registry app, mounted under /api/v1/.

models/[{id}/]                              served models (visible ones; staff write)
versions/[{id}/]  {id}/approve|deprecate|retire/   versions (approve: staff only)
adapters/[{id}/]                            LoRA adapters
deployments/[{id}/]  {id}/retire/            deployments; placement checked on write
rollouts/[{id}/]  {id}/pause|resume|abort|promote|rollback|advance/   staff only
"""

from django.urls import URLPattern, URLResolver
from rest_framework.routers import SimpleRouter

from registry.api.views import (
    AdapterViewSet,
    DeploymentViewSet,
    ModelVersionViewSet,
    ModelViewSet,
    RolloutViewSet,
)

router = SimpleRouter()
router.register(r"models", ModelViewSet, basename="registry-model")
router.register(r"versions", ModelVersionViewSet, basename="registry-version")
router.register(r"adapters", AdapterViewSet, basename="registry-adapter")
router.register(r"deployments", DeploymentViewSet, basename="registry-deployment")
router.register(r"rollouts", RolloutViewSet, basename="registry-rollout")

urlpatterns: list[URLPattern | URLResolver] = [*router.urls]
