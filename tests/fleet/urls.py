"""The project's routes plus the agents' API, until config/urls.py mounts it."""

from django.urls import include, path

urlpatterns = [
    path("api/agent/v1/", include("serving.api.agent_urls")),
    path("", include("config.urls")),
]
