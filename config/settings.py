"""Django settings, read from environment variables.

Defaults run a development instance; a bad value stops start-up with a message that names
the variable (see config/env.py).
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import dj_database_url
import django_stubs_ext

from config.env import (
    ImproperEnvironment,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_str,
    env_url,
)

# Lets Django's classes take type parameters at run time (admin.ModelAdmin[Model], ...).
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = env_bool("DEBUG", default=False)

_DEV_SECRET_KEY = "dev-only-insecure-secret-key-change-me-for-any-real-deployment-0123456789"
SECRET_KEY = env_str("SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperEnvironment(
            "SECRET_KEY", "", "a long random string (required when DEBUG is off)"
        )
    SECRET_KEY = _DEV_SECRET_KEY

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

DATABASE_URL = env_url(
    "DATABASE_URL",
    "postgres://postgres@127.0.0.1:5432/platform",
    schemes={"postgres", "postgresql", "pgsql"},
)
REDIS_URL = env_url("REDIS_URL", "redis://127.0.0.1:6379/0", schemes={"redis", "rediss", "unix"})

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    "django_otp",
    "django_otp.plugins.otp_totp",
    "tenants",
    "registry",
    "serving",
    "metering",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "config.middleware.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # A database timeout, in the session lookup or a view, is a fast 503 with Retry-After.
    "config.middleware.DatabaseUnavailableMiddleware",
    # A page's form or query holding a NUL character: a 400 with a message, not a 500.
    "config.middleware.NulCharactersRefused",
    "django_otp.middleware.OTPMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Staff with a second factor reach the console and the admin only once it is verified.
    "config.auth.StaffSecondFactorMiddleware",
    # Last: it turns a request axes flagged as locked out into the 429 login page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        DATABASE_URL, conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0)
    )
}
# A stalled PostgreSQL must cost a request seconds, not minutes: connecting gives up after
# DATABASE_CONNECT_TIMEOUT_S, and the server cancels a statement after
# DATABASE_STATEMENT_TIMEOUT_MS (a lock wait included) and ends a session left idle inside a
# transaction. The defaults suit web processes; the batch worker and the migrate Job set
# longer ones in their environment (scripts/run.py, platform/kubernetes/). 0 turns one off.
DATABASE_CONNECT_TIMEOUT_S = env_int("DATABASE_CONNECT_TIMEOUT_S", 3, minimum=0)
DATABASE_STATEMENT_TIMEOUT_MS = env_int("DATABASE_STATEMENT_TIMEOUT_MS", 5000, minimum=0)
DATABASE_LOCK_TIMEOUT_MS = env_int("DATABASE_LOCK_TIMEOUT_MS", 0, minimum=0)
DATABASE_IDLE_IN_TRANSACTION_TIMEOUT_MS = env_int(
    "DATABASE_IDLE_IN_TRANSACTION_TIMEOUT_MS", 60000, minimum=0
)
_DATABASE_OPTIONS = DATABASES["default"].setdefault("OPTIONS", {})
_DATABASE_OPTIONS["connect_timeout"] = DATABASE_CONNECT_TIMEOUT_S
# Options given in DATABASE_URL (`?options=...`) come last, so they win.
_DATABASE_OPTIONS["options"] = (
    f"-c statement_timeout={DATABASE_STATEMENT_TIMEOUT_MS}"
    f" -c lock_timeout={DATABASE_LOCK_TIMEOUT_MS}"
    f" -c idle_in_transaction_session_timeout={DATABASE_IDLE_IN_TRANSACTION_TIMEOUT_MS}"
    f" {_DATABASE_OPTIONS.get('options', '')}"
).strip()
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

# Login throttling (django-axes, config/auth.py): every authenticate() passes the axes backend
# first, the console's /login/ and the Django admin's login alike. Failures are counted per
# username (from any address) and per client address (over any usernames); once either count
# reaches its limit within the cool-off, further attempts are refused with a 429, a correct
# password included, until the cool-off has passed since the last failure. Staff unlock early by
# deleting the access attempts in the Django admin.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
LOGIN_FAILURES_PER_USER = env_int("LOGIN_FAILURES_PER_USER", 5, minimum=1)
LOGIN_FAILURES_PER_ADDRESS = env_int("LOGIN_FAILURES_PER_ADDRESS", 20, minimum=1)
LOGIN_COOL_OFF_MINUTES = env_int("LOGIN_COOL_OFF_MINUTES", 15, minimum=1)
# The request header that holds the client's address: REMOTE_ADDR when clients connect directly;
# behind a proxy, the one header that proxy sets (X-Forwarded-For: its right-most entry, the one
# the proxy appended). Any other header is the client's to forge. (Axes' AXES_IPWARE_* settings
# need django-ipware, which is not installed; config.auth.client_address reads this instead.)
LOGIN_CLIENT_ADDRESS_HEADER = env_str("LOGIN_CLIENT_ADDRESS_HEADER", "REMOTE_ADDR")
if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", LOGIN_CLIENT_ADDRESS_HEADER):
    raise ImproperEnvironment(
        "LOGIN_CLIENT_ADDRESS_HEADER",
        LOGIN_CLIENT_ADDRESS_HEADER,
        "REMOTE_ADDR or a header name such as X-Forwarded-For",
    )
if LOGIN_CLIENT_ADDRESS_HEADER != "REMOTE_ADDR" and not LOGIN_CLIENT_ADDRESS_HEADER.startswith(
    "HTTP_"
):
    LOGIN_CLIENT_ADDRESS_HEADER = "HTTP_" + LOGIN_CLIENT_ADDRESS_HEADER.upper().replace("-", "_")
AXES_HANDLER = "config.auth.LoginThrottle"
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_COOLOFF_TIME = timedelta(minutes=LOGIN_COOL_OFF_MINUTES)
# LoginThrottle.is_locked applies the two limits before the password is checked, so the attempt
# after the last allowed failure is the one refused. Axes' own check (one limit, flagging the
# failure that reaches it) is off; AXES_FAILURE_LIMIT only feeds the admin's attempt list.
AXES_LOCK_OUT_AT_FAILURE = False
AXES_FAILURE_LIMIT = LOGIN_FAILURES_PER_USER
# A refused attempt is not recorded: the cool-off runs from the last real failure, and the page
# can say when it ends.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
# LoginThrottle resets the user's count on success, never the address's: one good account must
# not wipe an address's failures against other accounts.
AXES_RESET_ON_SUCCESS = False
AXES_CLIENT_IP_CALLABLE = "config.auth.client_address"
AXES_LOCKOUT_CALLABLE = "config.auth.lockout_response"
AXES_VERBOSE = False

# Second factor (django-otp, config/auth.py): a user with a confirmed TOTP device enters its
# 6-digit code after the password, on the console's login and the Django admin's. Staff enrol a
# device at /login/two-factor/. When required, staff without one are sent there before any
# console or admin page.
PLATFORM_STAFF_MFA_REQUIRED = env_bool("PLATFORM_STAFF_MFA_REQUIRED", default=False)
OTP_TOTP_ISSUER = "Inference platform"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "django.contrib.staticfiles.storage.StaticFilesStorage"
            if DEBUG
            else "whitenoise.storage.CompressedStaticFilesStorage"
        )
    },
}
WHITENOISE_USE_FINDERS = True

# Security: with DEBUG off, `manage.py check --deploy` reports nothing. TLS ends at the load
# balancer in front of the gateway, which forwards X-Forwarded-Proto.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", default=not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz", r"^metrics$"]
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", default=not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", default=not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31536000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = not DEBUG
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# /metrics names every tenant with its models and token volumes: with a token set only
# `Authorization: Bearer <token>` reads it; without one only an unproxied loopback caller
# (config/middleware.py). Secret.
PLATFORM_METRICS_TOKEN = env_str("PLATFORM_METRICS_TOKEN")
# The whole request body must arrive within this many seconds (408 after it); 0 turns it off.
REQUEST_BODY_DEADLINE_S = env_float("REQUEST_BODY_DEADLINE_S", 30.0)
# HTTP requests and WebSockets one client address may hold open at once, per process
# (429 beyond it); 0 turns the cap off.
MAX_OPEN_REQUESTS_PER_CLIENT = env_int("MAX_OPEN_REQUESTS_PER_CLIENT", 64, minimum=0)

REST_FRAMEWORK = {
    # As config.api.AUTHENTICATION, the viewsets' own list: for the views outside them.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "tenants.api.authentication.ApiKeyAuthentication",
        "tenants.api.authentication.StaffTokenAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # DRF's three, the JSON one refusing bodies too deep or numbers too large with a 400.
    "DEFAULT_PARSER_CLASSES": [
        "config.parsers.JsonBodyParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
    # The actions' Django exceptions in DRF's error format (400, 403, 404), never a 500.
    "EXCEPTION_HANDLER": "config.api.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Inference platform API",
    "DESCRIPTION": "Control-plane REST API: tenants, registry, fleet, metering.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from the installed sidecar package, never a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL]},
    }
}

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "TIMEOUT": 300,
    }
}

# Every Redis call has a short timeout: an unreachable Redis must give a clear, fast error,
# never a hung request.
REDIS_SOCKET_TIMEOUT_S = env_float("REDIS_SOCKET_TIMEOUT_S", 0.5)
# Background work (publishing tables, invoices, usage ingest) waits longer before it fails.
REDIS_WORKER_TIMEOUT_S = env_float("REDIS_WORKER_TIMEOUT_S", 5.0)
# REDIS_URL names one node of a Redis Cluster: the limiter, key records, routing table,
# telemetry, catalog and usage stream (config/redis.py and the gateway) use a cluster client.
# Celery's broker, the Channels layer and Django's cache do not speak Cluster: they still take
# REDIS_URL as a plain Redis, and a cluster node answers them only for keys of its own slots
# (MOVED for the rest), so they need a plain Redis of their own, which no setting names yet.
REDIS_CLUSTER = env_bool("REDIS_CLUSTER", False)
if REDIS_CLUSTER and (
    urlparse(REDIS_URL).scheme == "unix" or urlparse(REDIS_URL).path.strip("/") not in {"", "0"}
):
    raise ImproperEnvironment(
        "REDIS_URL", REDIS_URL, "a redis:// or rediss:// URL of database 0 with REDIS_CLUSTER"
    )

# Runtime files: embedded PostgreSQL and Redis, logs, the gateway's usage spool, the demo's
# tiny model. On Kubernetes an emptyDir per pod.
PLATFORM_VAR_DIR = Path(env_str("PLATFORM_VAR_DIR", str(BASE_DIR / "var"))).resolve()
# A file:// model or adapter artifact must lie inside this directory, symlinks resolved
# (registry.models.check_artifact_file_uri); the demo's tiny model is built under it.
PLATFORM_MODEL_ROOT = Path(
    env_str("PLATFORM_MODEL_ROOT", str(PLATFORM_VAR_DIR / "models"))
).resolve()
# The platform's own URL as its node agents reach it (the demo fleet's agents join here).
PLATFORM_PUBLIC_URL = env_str("PLATFORM_PUBLIC_URL", "http://127.0.0.1:8000")

# The /v1 gateway (serving/gateway): routing policy and upstream timeouts.
GATEWAY_ROUTER_POLICY = env_str("GATEWAY_ROUTER_POLICY", "cost_aware")
if GATEWAY_ROUTER_POLICY not in {"round_robin", "least_load", "weighted_scorer", "cost_aware"}:
    raise ImproperEnvironment(
        "GATEWAY_ROUTER_POLICY",
        GATEWAY_ROUTER_POLICY,
        "one of round_robin, least_load, weighted_scorer, cost_aware",
    )
# Hold a standard or batch request at the gateway while every replica has more prompts
# queued than this share of interactive's TTFT objective (RouterConfig.defer_looser_after);
# empty: never (the default).
_DEFER = env_str("GATEWAY_DEFER_LOOSER_AFTER", "")
try:
    GATEWAY_DEFER_LOOSER_AFTER = float(_DEFER) if _DEFER else None
except ValueError:
    GATEWAY_DEFER_LOOSER_AFTER = -1.0
if GATEWAY_DEFER_LOOSER_AFTER is not None and not 0 < GATEWAY_DEFER_LOOSER_AFTER <= 10:
    raise ImproperEnvironment(
        "GATEWAY_DEFER_LOOSER_AFTER", _DEFER, "empty, or a number above 0 and at most 10"
    )
GATEWAY_CONNECT_TIMEOUT_S = env_float("GATEWAY_CONNECT_TIMEOUT_S", 2.0)
GATEWAY_READ_TIMEOUT_S = env_float("GATEWAY_READ_TIMEOUT_S", 30.0)
# Usage events that could not reach Redis wait here (one file per process when unset).
GATEWAY_SPOOL_PATH = env_str("GATEWAY_SPOOL_PATH", "")
# Guardrails run in order before admission: dotted paths of `(GuardrailInput) -> str | None`.
GATEWAY_GUARDRAILS = env_list(
    "GATEWAY_GUARDRAILS",
    ["serving.gateway.guardrails.prompt_size", "serving.gateway.guardrails.blocked_patterns"],
)
# A stream's concurrency lease outlives a crashed gateway by at most this long.
GATEWAY_STREAM_LEASE_TTL_S = env_int("GATEWAY_STREAM_LEASE_TTL_S", 600, minimum=1)
# Tracing of /v1 requests (serving/gateway/tracing.py): spans go over OTLP/HTTP to this traces
# URL (http://collector:4318/v1/traces); empty is off, and off costs nothing per request.
OTEL_TRACES_ENDPOINT = env_str("OTEL_TRACES_ENDPOINT", "")
if OTEL_TRACES_ENDPOINT:
    env_url("OTEL_TRACES_ENDPOINT", "", schemes={"http", "https"})
# The share of requests traced (a request that arrives with a traceparent follows its flag).
OTEL_TRACES_SAMPLE_RATIO = env_float("OTEL_TRACES_SAMPLE_RATIO", 1.0)
if not 0.0 <= OTEL_TRACES_SAMPLE_RATIO <= 1.0:
    raise ImproperEnvironment(
        "OTEL_TRACES_SAMPLE_RATIO", str(OTEL_TRACES_SAMPLE_RATIO), "a number from 0 to 1"
    )
OTEL_SERVICE_NAME = env_str("OTEL_SERVICE_NAME", "inference-gateway")
# The engine simulator's clock: 1.0 is real time, larger runs simulated replicas faster.
SERVING_SIM_TIME_SCALE = env_float("SERVING_SIM_TIME_SCALE", 1.0)
# Simulated replicas stop at a drawn EOS even when max_tokens is set, as a real model does
# (`make run` turns it on); off, a request given max_tokens writes exactly that many tokens.
SERVING_SIM_STOP_AT_EOS = env_bool("SERVING_SIM_STOP_AT_EOS", default=False)
# How long a node drain may stay blocked (a replica with nowhere to go) before the console
# asks staff to force or cancel it; one drain may set its own (drain_deadline_s).
NODE_DRAIN_DEADLINE_S = env_int("NODE_DRAIN_DEADLINE_S", 600, minimum=0)

# The demo fleet (`make run`): simulated GPU nodes only, or also one CPU node running real vLLM
# (its CPU build, installed into VLLM_PYTHON's virtual environment) serving a tiny model.
PLATFORM_DEMO_ENGINE = env_str("PLATFORM_DEMO_ENGINE", "simulator")
if PLATFORM_DEMO_ENGINE not in {"simulator", "vllm"}:
    raise ImproperEnvironment("PLATFORM_DEMO_ENGINE", PLATFORM_DEMO_ENGINE, "simulator or vllm")
VLLM_PYTHON = env_str("VLLM_PYTHON", str(BASE_DIR / ".venv-vllm" / "bin" / "python"))

# The autoscaler's forecast (serving/actions/autoscale.py): the period of the traffic pattern
# it learns, in seconds (a day); 0 turns the forecast off.
AUTOSCALER_FORECAST_PERIOD_S = env_int("AUTOSCALER_FORECAST_PERIOD_S", 86400, minimum=0)
if 0 < AUTOSCALER_FORECAST_PERIOD_S < 3600:
    raise ImproperEnvironment(
        "AUTOSCALER_FORECAST_PERIOD_S",
        str(AUTOSCALER_FORECAST_PERIOD_S),
        "0 (no forecast) or a period of at least 3600 seconds",
    )

CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Two queues by latency class. `realtime`: loops measured in seconds (usage ingest every
# second, the routing table, reconcile, node health, the console's live feed, rollout ticks,
# the key, price and visibility publishes). `batch`: work measured in minutes (rollups,
# invoices, budgets, key last-used flushes), so a long invoice run never delays an ingest.
# Each worker command (scripts/run.py, platform/) names the queue it serves.
CELERY_TASK_DEFAULT_QUEUE = "realtime"
CELERY_TASK_ROUTES = {
    name: {"queue": "batch"}
    for name in (
        "metering.rollup_recent_hours",
        "metering.rollup_hour",
        "metering.refresh_invoices",
        "metering.check_budgets",
        "metering.maintain_partitions",
        "tenants.flush_key_last_used",
    )
}
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
# Usage events older than this many whole months before the current one are dropped, a month's
# partition at a time (metering.partitions); 0 keeps them all. Invoices and rollups stay.
USAGE_RETENTION_MONTHS = env_int("USAGE_RETENTION_MONTHS", 24, minimum=0)
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULE: dict[str, dict[str, object]] = {}

EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "platform@localhost")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", default=False)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
