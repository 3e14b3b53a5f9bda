from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from config import auth, health, views
from config.api import unrouted

# The admin logs in through config.auth's throttled, two-step page (django-otp's documented way
# of swapping the default site's class).
admin.site.__class__ = auth.PlatformAdminSite

api_v1 = [
    path("", include("tenants.api.urls")),
    path("", include("tenants.api.staff_token_urls")),
    path("", include("registry.api.urls")),
    path("", include("serving.api.urls")),
    path("", include("metering.api.urls")),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
]

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("readyz/gateway", health.readyz_gateway, name="readyz-gateway"),
    path("login/", auth.LoginView.as_view(), name="login"),
    path("login/code/", auth.login_code, name="login-code"),
    path("login/two-factor/", auth.enroll_device, name="two-factor-enroll"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.home, name="home"),
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/agent/v1/", include("serving.api.agent_urls")),
    # Any other path under /api, such as one missing its trailing slash: DRF's JSON 404
    # with a hint, not Django's redirect (which drops a POST's body) or HTML page.
    path("api", unrouted),
    path("api/", unrouted),
    path("api/<path:rest>", unrouted, name="api-unrouted-any"),
    path("console/", include("serving.console.urls")),
    path("console/", include("registry.urls")),
    path("console/", include("metering.urls")),
    path("console/", include("tenants.console_urls")),
    # The tenant portal: each app renders its own pages in the portal's frame (tenants/views.py).
    path("portal/", include("tenants.portal_urls")),
    path("portal/", include("metering.portal_urls")),
    path("portal/", include("serving.console.portal_urls")),
]
