"""Routes of the node agents' API, to be mounted at /api/agent/v1/ by config/urls.py."""

from django.urls import URLPattern, path

from serving.api import agent

urlpatterns: list[URLPattern] = [
    path("register", agent.register, name="agent-register"),
    path("heartbeat", agent.heartbeat, name="agent-heartbeat"),
]
