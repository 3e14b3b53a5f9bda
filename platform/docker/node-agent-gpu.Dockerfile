# syntax=docker/dockerfile:1
# The node agent on GPU nodes (platform/kubernetes/node-agent.yaml): `python -m serving.agent`
# and the CUDA build of vLLM it launches, in the same interpreter. Build from the repository root:
#   docker build -f platform/docker/node-agent-gpu.Dockerfile -t registry.example.internal/llm-node-agent:TAG .
# The base is vLLM's own CUDA image at the version requirements-node.txt pins (a test keeps the
# two equal), so pip finds vllm installed and adds only the agent's packages. The NVIDIA
# container runtime mounts the driver and libnvidia-ml at run time.
FROM vllm/vllm-openai:v0.33.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/opt/llm-platform
COPY requirements-node.txt /tmp/requirements-node.txt
RUN python3 -m pip install -r /tmp/requirements-node.txt \
    # The manifest runs `python -m serving.agent`.
    && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; } \
    && groupadd --system --gid 10001 agent \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/agent \
        --shell /usr/sbin/nologin agent
WORKDIR /opt/llm-platform
# The agent imports serving.agent and serving.engine (GPU specs), nothing of Django.
COPY serving/ serving/
USER 10001:10001
ENTRYPOINT ["python", "-m", "serving.agent"]
CMD ["--help"]
