"""Console pages of the serving app (mounted under /console/)."""

from django.urls import URLPattern, URLResolver, path

from serving.console import views
from serving.console.planner import capacity_planner

urlpatterns: list[URLPattern | URLResolver] = [
    path("", views.overview, name="console-overview"),
    path("fleet/", views.fleet, name="console-fleet"),
    path("fleet/nodes/<int:node_id>/<str:action>/", views.node_action, name="console-node-action"),
    path("fleet/replicas/<int:replica_id>/", views.replica_detail, name="console-replica"),
    path("planner/", capacity_planner, name="console-planner"),
]
