"""The deployment as a cluster would receive it, checked offline.

Every manifest in platform/kubernetes and the output of each kustomize build (the base, and the
dev and production overlays in platform/overlays, rendered by `kubectl kustomize`) is validated
against the OpenAPI schemas of a current Kubernetes release in strict mode (kubernetes-validate):
a misspelt field, a wrong type or a missing required field fails here, not at `kubectl apply`.

The images cannot be built here (no registry to pull the bases from), so the Dockerfiles in
platform/docker are checked for what can be seen without building them: a non-root final user,
bases pinned by tag, the lock file installed with its hashes, every COPY source present. And
the two sides are held together: each image a manifest runs is one platform/README.md says how
to build, from a Dockerfile that installs what the manifest's command needs, as the uid the
pod runs as."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "platform" / "kubernetes"
OVERLAYS = ROOT / "platform" / "overlays"
DOCKER = ROOT / "platform" / "docker"
README = ROOT / "platform" / "README.md"

# The newest release whose schemas kubernetes-validate ships (1.37.0 in kubernetes-validate
# 1.37.0); move it on when the package is upgraded.
KUBERNETES_VERSION = "1.37"

KUSTOMIZATIONS = {
    "base": KUBERNETES,
    "dev": OVERLAYS / "dev",
    "production": OVERLAYS / "production",
}
DOCKERFILES = ("control-plane", "node-agent-gpu", "node-agent-cpu")
# The one container allowed to run as root: it hands the node agent's hostPath state directory
# (created by kubelet, owned by root) to the agent's uid, with CHOWN as its only capability.
ROOT_INIT_CONTAINER = "state-dir-owner"
# Programs every base image has (coreutils), as opposed to those a requirements file installs.
BASE_PROGRAMS = {"chown"}
README_BUILD = re.compile(r"docker build -f platform/docker/(\S+)\.Dockerfile -t (\S+?):\S+ \.")
WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet", "Job"}


def manifest_documents() -> list[tuple[str, dict[str, Any]]]:
    """Every object in platform/kubernetes/*.yaml, with the file it is in."""
    return [
        (path.name, doc)
        for path in sorted(KUBERNETES.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


@functools.cache
def kustomize_build(name: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not on PATH: the kustomize builds of platform/kubernetes and "
            "platform/overlays cannot be rendered. Install kubectl (it bundles kustomize)."
        )
    directory = KUSTOMIZATIONS[name]
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def schema_errors(doc: dict[str, Any]) -> str | None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except ValidationError as error:
        where = ".".join(str(part) for part in error.path) or "(top level)"
        return f"{doc['kind']}/{doc['metadata']['name']} at {where}: {error.message}"
    except SchemaNotFoundError as error:
        return f"{doc['kind']}/{doc['metadata']['name']}: {error.message}"
    return None


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def workloads(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def all_objects() -> tuple[dict[str, Any], ...]:
    """The files (the migrate Job is in no kustomization) and every build, for the image checks."""
    built = tuple(doc for name in KUSTOMIZATIONS for doc in kustomize_build(name))
    return tuple(doc for _, doc in manifest_documents()) + built


def selects(selector: dict[str, Any], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


# --- Dockerfiles ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def instructions(dockerfile: str) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined and comments dropped."""
    lines = [
        line
        for line in (DOCKER / f"{dockerfile}.Dockerfile").read_text().splitlines()
        if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    parsed = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, arguments = line.strip().partition(" ")
            parsed.append(Instruction(keyword.upper(), arguments.strip()))
    return parsed


def final_stage(dockerfile: str) -> list[Instruction]:
    steps = instructions(dockerfile)
    last_from = max(i for i, step in enumerate(steps) if step.keyword == "FROM")
    return steps[last_from:]


def base_images(dockerfile: str) -> list[str]:
    steps = instructions(dockerfile)
    stages = {step.arguments.split()[-1] for step in steps if " AS " in step.arguments.upper()}
    images = [step.arguments.split()[0] for step in steps if step.keyword == "FROM"]
    return [image for image in images if image not in stages]


def copy_sources(dockerfile: str) -> list[str]:
    """What each COPY from the build context (not from another stage) takes."""
    sources = []
    for step in instructions(dockerfile):
        if step.keyword != "COPY" or "--from=" in step.arguments:
            continue
        words = [word for word in step.arguments.split() if not word.startswith("--")]
        sources.extend(words[:-1])
    return sources


def final_uid(dockerfile: str) -> int:
    users = [step.arguments for step in final_stage(dockerfile) if step.keyword == "USER"]
    assert users, f"{dockerfile}.Dockerfile sets no USER: its processes would run as root"
    user = users[-1].split(":")[0]
    assert user.isdigit(), f"{dockerfile}.Dockerfile: USER {user} should be numeric"
    return int(user)


def installed_requirements(dockerfile: str) -> str:
    """The text of the requirements files the Dockerfile copies in."""
    names = [s for s in copy_sources(dockerfile) if re.fullmatch(r"requirements[\w-]*\.txt", s)]
    return "\n".join((ROOT / name).read_text() for name in names)


def images_in_readme() -> dict[str, str]:
    """The image each Dockerfile is built as, by platform/README.md's `docker build` lines."""
    return {image: dockerfile for dockerfile, image in README_BUILD.findall(README.read_text())}


def image_repository(image: str) -> str:
    return image.rsplit(":", 1)[0]


def missing_from_image(command: list[str], dockerfile: str) -> str | None:
    """Why the image built from `dockerfile` cannot run `command`, or None if it can."""
    program = command[0]
    copied = {source.rstrip("/") for source in copy_sources(dockerfile)}
    if program == "python":
        if command[1] == "-m":
            package = command[2].split(".")[0]
            module = ROOT / command[2].replace(".", "/")
            if not ((module / "__main__.py").exists() or module.with_suffix(".py").exists()):
                return f"no module {command[2]} in the repository"
        else:
            package = command[1]
        return None if package in copied else f"{dockerfile}.Dockerfile copies no {package}"
    if program in BASE_PROGRAMS:
        return None
    pinned = re.search(rf"^{re.escape(program)}==", installed_requirements(dockerfile), re.M)
    return None if pinned else f"{dockerfile}.Dockerfile installs no {program}"


@pytest.mark.parametrize(
    "doc",
    [doc for _, doc in manifest_documents()],
    ids=[f"{path}:{doc['kind']}/{doc['metadata']['name']}" for path, doc in manifest_documents()],
)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(doc: dict[str, Any]) -> None:
    assert schema_errors(doc) is None, schema_errors(doc)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_of_each_kustomize_build_is_valid_against_the_schemas(name: str) -> None:
    docs = kustomize_build(name)
    assert docs, f"kubectl kustomize {KUSTOMIZATIONS[name]} rendered nothing"
    errors = [error for error in map(schema_errors, docs) if error]
    assert not errors, "\n".join(errors)


def test_the_base_renders_every_object_its_files_list() -> None:
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    in_files = {
        (doc["kind"], doc["metadata"]["name"])
        for path, doc in manifest_documents()
        if path in listed
    }
    rendered = {(doc["kind"], doc["metadata"]["name"]) for doc in kustomize_build("base")}
    assert rendered == in_files


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_an_hpa_never_fights_the_replica_count_it_scales(name: str) -> None:
    docs = kustomize_build(name)
    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        target = find(
            docs, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"]
        )
        low, high = hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]
        assert low <= target["spec"]["replicas"] <= high, f"{name}: {hpa['metadata']['name']}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_disruption_budget_covers_a_workload_and_still_lets_a_node_drain(name: str) -> None:
    docs = kustomize_build(name)
    for budget in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        covered = [w for w in workloads(docs) if selects(budget["spec"]["selector"], w)]
        assert len(covered) == 1, f"{name}: {budget['metadata']['name']} covers {len(covered)}"
        floor = budget["spec"].get("minAvailable")
        if isinstance(floor, int):
            replicas = covered[0]["spec"]["replicas"]
            assert floor < replicas, f"{name}: {budget['metadata']['name']} blocks every drain"


def test_production_runs_more_gateways_with_a_budget_and_an_autoscaler() -> None:
    docs = kustomize_build("production")
    gateway = find(docs, "Deployment", "gateway")
    hpa = find(docs, "HorizontalPodAutoscaler", "gateway")
    budget = find(docs, "PodDisruptionBudget", "gateway")
    base_gateway = find(kustomize_build("base"), "Deployment", "gateway")
    assert gateway["spec"]["replicas"] > base_gateway["spec"]["replicas"]
    assert hpa["spec"]["minReplicas"] == gateway["spec"]["replicas"]
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert selects(budget["spec"]["selector"], gateway)
    assert find(docs, "PodDisruptionBudget", "celery-worker-realtime")


def test_production_spreads_gateways_and_realtime_workers_over_zones() -> None:
    docs = kustomize_build("production")
    for name in ("gateway", "celery-worker-realtime"):
        spread = pod_spec(find(docs, "Deployment", name))["topologySpreadConstraints"]
        keys = {constraint["topologyKey"] for constraint in spread}
        assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, name


def test_every_production_container_requests_cpu_and_memory_and_caps_memory() -> None:
    for workload in workloads(kustomize_build("production")):
        for container in containers(pod_spec(workload)):
            resources = container["resources"]
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert {"cpu", "memory"} <= set(resources["requests"]), where
            assert "memory" in resources["limits"], where


def test_production_applies_no_placeholder_secret() -> None:
    assert not [d for d in kustomize_build("production") if d["kind"] == "Secret"]


def test_dev_runs_one_of_everything() -> None:
    docs = kustomize_build("dev")
    assert {
        d["metadata"]["name"]: d["spec"]["replicas"] for d in docs if d["kind"] == "Deployment"
    } == {
        "gateway": 1,
        "celery-worker-realtime": 1,
        "celery-worker-batch": 1,
        "celery-beat": 1,
    }
    assert find(docs, "HorizontalPodAutoscaler", "gateway")["spec"]["minReplicas"] == 1


def test_dev_runs_the_cpu_node_agent_without_claiming_gpus() -> None:
    agent = pod_spec(find(kustomize_build("dev"), "DaemonSet", "node-agent"))
    container = agent["containers"][0]
    assert images_in_readme()[image_repository(container["image"])] == "node-agent-cpu"
    assert any(arg.startswith("--cpu-slots=") for arg in container["command"])
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert "nvidia.com/gpu.present" not in agent["nodeSelector"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_each_image_runs_as_a_non_root_user(dockerfile: str) -> None:
    assert final_uid(dockerfile) != 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_each_base_image_is_pinned_by_a_tag(dockerfile: str) -> None:
    for image in base_images(dockerfile):
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, f"{dockerfile}: FROM {image}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_lock_file_is_installed_with_its_hashes(dockerfile: str) -> None:
    runs = [step.arguments for step in instructions(dockerfile) if step.keyword == "RUN"]
    for run in runs:
        if re.search(r"(?<![\w-])requirements\.txt", run):
            assert "--require-hashes" in run, f"{dockerfile}: {run}"


def test_the_control_plane_image_installs_the_lock_file() -> None:
    assert "requirements.txt" in copy_sources("control-plane")


def test_the_gpu_image_is_built_on_the_vllm_release_requirements_node_pins() -> None:
    pinned = re.search(r"^vllm==(\S+)", (ROOT / "requirements-node.txt").read_text(), re.M)
    assert pinned
    assert base_images("node-agent-gpu") == [f"vllm/vllm-openai:v{pinned[1]}"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_path_a_dockerfile_copies_is_in_the_build_context(dockerfile: str) -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for source in copy_sources(dockerfile):
        assert (ROOT / source).exists(), f"{dockerfile}: COPY {source}: no such path"
        assert source.rstrip("/").split("/")[0] not in ignored, f"{dockerfile}: {source} ignored"


def test_the_readme_says_how_to_build_each_dockerfile() -> None:
    assert sorted(images_in_readme().values()) == sorted(DOCKERFILES)


def test_the_gateway_and_the_node_agent_run_the_images_the_readme_builds() -> None:
    built = images_in_readme()
    docs = kustomize_build("base")
    gateway = pod_spec(find(docs, "Deployment", "gateway"))["containers"][0]
    agent = pod_spec(find(docs, "DaemonSet", "node-agent"))["containers"][0]
    assert built[image_repository(gateway["image"])] == "control-plane"
    assert built[image_repository(agent["image"])] == "node-agent-gpu"


def test_every_container_runs_a_command_its_image_has_as_the_uid_the_image_sets() -> None:
    built = images_in_readme()
    problems = []
    for workload in workloads(all_objects()):
        spec = pod_spec(workload)
        for container in containers(spec):
            where = f"{workload['metadata']['name']}/{container['name']}"
            dockerfile = built.get(image_repository(container["image"]))
            if dockerfile is None:
                problems.append(f"{where}: {container['image']} is built by no Dockerfile")
                continue
            if reason := missing_from_image(container["command"], dockerfile):
                problems.append(f"{where}: {reason}")
            security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
            if container["name"] == ROOT_INIT_CONTAINER:
                continue
            if not security.get("runAsNonRoot"):
                problems.append(f"{where}: not runAsNonRoot")
            if security.get("runAsUser", final_uid(dockerfile)) != final_uid(dockerfile):
                problems.append(f"{where}: runAsUser differs from {dockerfile}'s USER")
    assert not problems, "\n".join(problems)
