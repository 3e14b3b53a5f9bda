# syntax=docker/dockerfile:1
# The control plane: gateway (uvicorn), Celery workers and beat, the migrate Job. One image,
# the command picks the process (platform/kubernetes/*.yaml). Build from the repository root:
#   docker build -f platform/docker/control-plane.Dockerfile -t registry.example.internal/llm-platform:TAG .

# Stage 1: the locked dependencies, every one checked against its hash, in a virtual
# environment that the runtime stage copies whole (no pip cache, no build tools in the image).
FROM python:3.11-slim-bookworm AS dependencies
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY requirements.txt /tmp/requirements.txt
RUN /opt/venv/bin/pip install --require-hashes --no-deps -r /tmp/requirements.txt

# Stage 2: the router's hot path compiled with mypyc (serving/router/native.py), with the dev
# lock's mypy and a C compiler that the runtime image does not carry: only the build is copied.
# The build script exits 0 when it cannot compile (the router then runs as Python), so the
# step checks that a build is there.
FROM python:3.11-slim-bookworm AS router
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY requirements-dev.txt /tmp/requirements-dev.txt
RUN python -m venv /opt/build \
    && /opt/build/bin/pip install --require-hashes --no-deps -r /tmp/requirements-dev.txt
WORKDIR /opt/llm-platform
COPY serving/ serving/
COPY scripts/build_router.py scripts/build_router.py
RUN /opt/build/bin/python scripts/build_router.py && test -n "$(ls var/router-native)"

# Stage 3: the runtime.
FROM python:3.11-slim-bookworm
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DJANGO_SETTINGS_MODULE=config.settings \
    PLATFORM_VAR_DIR=/var/lib/platform
# The uid and gid the manifests run as (securityContext.runAsUser: 10001).
RUN groupadd --system --gid 10001 platform \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin platform \
    && install -d -o 10001 -g 10001 /var/lib/platform /var/lib/celerybeat
COPY --from=dependencies /opt/venv /opt/venv
WORKDIR /opt/llm-platform
COPY manage.py pyproject.toml ./
COPY config/ config/
COPY metering/ metering/
COPY registry/ registry/
COPY serving/ serving/
# The compiled router, made from the same serving/ sources (it is loaded only while they match).
COPY --from=router /opt/llm-platform/var/router-native/ var/router-native/
COPY tenants/ tenants/
COPY static/ static/
COPY templates/ templates/
# Static files are collected (and compressed for WhiteNoise) here, once, because the pods'
# root filesystem is read-only. The key only satisfies the settings' check for this one step;
# the real one comes from the Secret. Bytecode is compiled now for the same reason.
RUN DEBUG=false SECRET_KEY=collectstatic-at-image-build-time-only-never-used-to-sign-anything \
        python manage.py collectstatic --noinput \
    && python -m compileall -q config metering registry serving tenants
# The compiled router loads (where no build loads, serving/router/native.py runs it as Python).
RUN python -c "import serving.router.native as n; assert n.active(), 'router build not loaded'"
USER 10001:10001
EXPOSE 8000
# The gateway; Celery and the migrate Job set their own command.
CMD ["uvicorn", "config.asgi:application", "--host=0.0.0.0", "--port=8000", "--lifespan=off"]
