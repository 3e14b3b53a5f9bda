"""Console pages of the registry app (mounted under /console/)."""

from django.urls import URLPattern, URLResolver, path

from registry import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("models/", views.models_page, name="console-models"),
    path(
        "models/versions/<int:version_id>/approve/",
        views.approve_version,
        name="console-approve-version",
    ),
    path("models/versions/create/", views.create_version, name="console-create-version"),
    path("deployments/check/", views.placement_check, name="console-placement-check"),
    path("deployments/create/", views.create_deployment, name="console-create-deployment"),
    path(
        "deployments/<int:deployment_id>/retire/",
        views.retire_deployment,
        name="console-retire-deployment",
    ),
    path("rollouts/", views.rollouts_page, name="console-rollouts"),
    path("rollouts/start/", views.start_rollout, name="console-start-rollout"),
    path("rollouts/<int:rollout_id>/", views.rollout_detail, name="console-rollout"),
    path(
        "rollouts/<int:rollout_id>/<str:action>/",
        views.rollout_action,
        name="console-rollout-action",
    ),
]
