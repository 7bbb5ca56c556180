"""The container files agree with the package and with each other (docker/, deploy/k8s/, .dockerignore).

No Docker engine or cluster runs here, so these read the files: the versions pinned in docker/versions.env
against pyproject.toml's bounds, transformers' own bounds and what this suite runs on; the healthchecks
and probes against vitserve's real routes and flags (tests/integration/test_healthcheck_script.py runs the
HEALTHCHECK script against an HTTP server).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import yaml
from fastapi.testclient import TestClient
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vitserve.api.app import create_app
from vitserve.config import Config
from vitserve.engine import Engine
from vitserve.flags import build_config
from vitserve.metrics import Metrics
from vitserve.processors import load_image_processor

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "docker" / "Dockerfile.cpu", ROOT / "docker" / "Dockerfile.cuda"]
MANIFEST = ROOT / "deploy" / "k8s" / "vitserve-pod.yaml"


def pins() -> dict[str, str]:
    lines = (ROOT / "docker" / "versions.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def dependency(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return next(r for r in reqs if r.name == name)


def requires_python() -> SpecifierSet:
    return SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])


# ------------------------------------------------------------------------------------------------------
# Versions: one place, inside the bounds, and what the suite runs
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_take_every_version_from_versions_env(dockerfile):
    text = dockerfile.read_text()
    args = re.findall(r"^ARG\s+(\S+)", text, re.MULTILINE)
    assert args, "the versions come in as build arguments"
    assert all("=" not in a for a in args), (
        f"an ARG with a default pins a version outside versions.env: {args}"
    )
    assert set(args) <= set(pins()), f"{set(args) - set(pins())} are not in docker/versions.env"
    for line in re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE):
        assert line == "python:${PYTHON_VERSION}-slim", f"{dockerfile.name}: FROM {line} pins its own version"
    for pinned in ("torch==${TORCH_VERSION}", "transformers==${TRANSFORMERS_VERSION}"):
        assert pinned in text
    code = "\n".join(line for line in text.splitlines() if not line.startswith("#")).replace("0.0.0.0", "")
    assert not re.search(r"\d+\.\d+", code), f"{dockerfile.name} names a version itself"


def test_pins_are_inside_pyproject_bounds():
    v = pins()
    assert Version(v["PYTHON_VERSION"]) in requires_python()
    assert Version(v["TORCH_VERSION"]) in dependency("torch").specifier
    assert Version(v["TRANSFORMERS_VERSION"]) in dependency("transformers").specifier


def test_pins_are_what_the_suite_runs_and_what_transformers_accepts():
    """The images ship the versions this suite passed on; transformers' own Requires-Python and torch bound
    (read from the installed, pinned transformers) accept the pinned Python and torch."""
    v = pins()
    running = {
        "PYTHON_VERSION": f"{sys.version_info.major}.{sys.version_info.minor}",
        "TORCH_VERSION": Version(torch.__version__).base_version,
        "TRANSFORMERS_VERSION": importlib.metadata.version("transformers"),
    }
    for key, version in running.items():
        assert v[key] == version, f"docker/versions.env pins {key}={v[key]} but the suite runs {version}"
    meta = importlib.metadata.metadata("transformers")
    assert Version(v["PYTHON_VERSION"]) in SpecifierSet(meta["Requires-Python"])
    torch_reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or [] if r.startswith("torch")]
    torch_bound = next(r for r in torch_reqs if r.name == "torch" and 'extra == "torch"' in str(r.marker))
    assert Version(v["TORCH_VERSION"]) in torch_bound.specifier
    # pyproject's own bounds are never looser than transformers' (it would claim what cannot install)
    assert all(
        Version(s.version) >= Version("2.6") for s in dependency("torch").specifier if ">" in s.operator
    )


# ------------------------------------------------------------------------------------------------------
# Images: non-root, /ready healthcheck, small context
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_uid_1000_and_check_ready(dockerfile):
    text = dockerfile.read_text()
    final = text.rsplit("\nFROM ", 1)[1]  # the runtime stage
    assert re.search(r"^USER 1000:1000$", final, re.MULTILINE)
    check = re.search(r"^HEALTHCHECK (.*?)\\\n\s+CMD (.*)$", final, re.MULTILINE)
    assert check, "the runtime image has a HEALTHCHECK"
    assert "--start-period=" in check.group(1)
    assert "vitserve-healthcheck.py" in check.group(2)
    assert "COPY docker/healthcheck.py /usr/local/lib/vitserve-healthcheck.py" in final


def test_dockerignore_keeps_venv_git_outputs_and_caches_out():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()}
    for entry in (".git", ".venv", "bench", "**/__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"):
        assert entry in ignored
    assert not ignored & {"vitserve", "pyproject.toml", "README.md", "docker"}, "the build needs these"


def test_compose_receiver_has_its_own_healthcheck_and_build_args_come_from_versions_env():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    receiver, vitserve = compose["services"]["receiver"], compose["services"]["vitserve"]
    bind = receiver["command"][receiver["command"].index("--bind") + 1]
    socket_path = bind.removeprefix("ipc://")
    assert socket_path in " ".join(receiver["healthcheck"]["test"]), "it checks its own socket"
    assert "8100" not in str(receiver["healthcheck"])
    assert "healthcheck" not in vitserve, "vitserve keeps the image's /ready check"
    assert vitserve["depends_on"]["receiver"]["condition"] == "service_healthy"
    command = vitserve["command"]
    assert command[command.index("--llm_endpoint") + 1] == bind
    args = receiver["build"]["args"]
    assert set(args) == set(pins())
    assert all(value.startswith(f"${{{key}:?") for key, value in args.items())


def test_compose_vllm_pairs_the_flags_both_sides_need():
    """docker/compose.vllm.yaml (docs/vllm.md): vitserve's command parses with the real flag parser and points
    --llm_url at the vLLM service, which takes embeddings; both read the same checkpoint."""
    compose = yaml.safe_load((ROOT / "docker" / "compose.vllm.yaml").read_text())
    vllm, vitserve = compose["services"]["vllm"], compose["services"]["vitserve"]
    assert "--enable-mm-embeds" in vllm["command"]
    assert any(a.startswith("--limit-mm-per-prompt=") and '"image":0' in a for a in vllm["command"])
    assert vitserve["depends_on"]["vllm"]["condition"] == "service_healthy"
    command = vitserve["command"]
    config = build_config(command, {"VITSERVE_VISUAL_BATCH_MAX_TOKENS": "8192"})
    assert config.llm_url == "http://vllm:8000"
    assert config.host == "0.0.0.0"
    assert vllm["volumes"][0].rsplit(":", 2)[1] == config.model == "/model"
    grace = int(vitserve["stop_grace_period"].removesuffix("s"))
    assert grace > config.request_timeout_s + config.llm_timeout_s  # the drain can finish a completion
    assert set(vitserve["build"]["args"]) <= set(pins())


# ------------------------------------------------------------------------------------------------------
# Kubernetes: probes on the real routes and flags
# ------------------------------------------------------------------------------------------------------


def _pod() -> dict:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]


def _container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


def _config(container: dict, env: dict[str, str]) -> Config:
    """The container's flags as vitserve reads them (--model swapped for demo: no checkpoint here)."""
    args = ["--model=demo" if a.startswith("--model=") else a for a in container["args"]]
    return build_config(args, env)


def _port(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_k8s_probes_hit_vitserve_routes_on_its_port():
    pod = _pod()
    c = _container(pod, "vitserve")
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    config = _config(c, env)
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {kind: p["path"] for kind, p in probes.items()} == {
        "startupProbe": "/ready",
        "readinessProbe": "/ready",
        "livenessProbe": "/health",
    }
    assert all(_port(c, p["port"]) == config.port for p in probes.values())
    assert int(env["VITSERVE_PORT"]) == config.port, "the image's HEALTHCHECK script reads it"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "a cold start of a real checkpoint"
    # before the engine is up, the liveness route is 200 and the readiness route is not
    processor = load_image_processor("qwen2_5_vl", budget_tokens=config.budget_tokens)
    metrics = Metrics()
    app = create_app(Config(), Engine(Config(), metrics), processor, metrics)
    with TestClient(app) as client:
        assert client.get(probes["livenessProbe"]["path"]).status_code == 200
        assert client.get(probes["readinessProbe"]["path"]).status_code == 503


def test_k8s_pod_shares_the_ipc_socket_and_drains_before_sigkill():
    pod = _pod()
    llm, vs = _container(pod, "llm"), _container(pod, "vitserve")
    config = _config(vs, {})
    bind = llm["command"][llm["command"].index("--bind") + 1]
    assert config.llm_endpoint == bind
    socket_dir = str(Path(bind.removeprefix("ipc://")).parent)
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (llm, vs)}
    shared = mounts["llm"][socket_dir]
    assert mounts["vitserve"][socket_dir] == shared
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == shared)
    pre_stop = int(vs["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + config.request_timeout_s + 10


def test_k8s_runs_non_root_with_capabilities_dropped():
    pod = _pod()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    for c in pod["containers"]:
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_api_docs_give_the_manifests_probe_settings():
    """docs/api.md's probe block is what deploy/k8s/vitserve-pod.yaml ships (numbers that drift apart confuse)."""
    text = (ROOT / "docs" / "api.md").read_text()
    block = re.search(r"```yaml\n(startupProbe:.*?)```", text, re.S)
    assert block, "docs/api.md has no probe block"
    documented = yaml.safe_load(block.group(1))
    pod = _pod()
    shipped = _container(pod, "vitserve")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        want = {k: v for k, v in shipped[kind].items() if k != "httpGet"}
        got = {k: v for k, v in documented[kind].items() if k != "httpGet"}
        assert got == want, kind
        assert documented[kind]["httpGet"]["path"] == shipped[kind]["httpGet"]["path"]
    assert documented["terminationGracePeriodSeconds"] == pod["terminationGracePeriodSeconds"]


# ------------------------------------------------------------------------------------------------------
# Kubernetes: N replicas sharing one Redis (docs/scaling.md)
# ------------------------------------------------------------------------------------------------------

REPLICAS = ROOT / "deploy" / "k8s" / "vitserve-replicas.yaml"


def _replica_docs() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(REPLICAS.read_text())}


def test_k8s_replicas_read_the_cache_url_from_a_secret_and_pass_real_flags():
    docs = _replica_docs()
    pod = docs[("Deployment", "vitserve-replicas")]["spec"]["template"]["spec"]
    c = _container(pod, "vitserve")
    env = {e["name"]: e for e in c["env"]}
    assert "secretKeyRef" in env["VITSERVE_CACHE_URL"]["valueFrom"], "the password stays out of argv"
    assert not any("cache_url" in a for a in c["args"])
    config = _config(c, {"VITSERVE_PORT": env["VITSERVE_PORT"]["value"],
                         "VITSERVE_CACHE_URL": "redis://:pw@vitserve-redis:6379/0"})  # fmt: skip
    assert config.cache_url == "redis://:pw@vitserve-redis:6379/0"
    assert config.cache_ttl_s > 0
    assert config.port == int(env["VITSERVE_PORT"]["value"])
    assert docs[("Deployment", "vitserve-replicas")]["spec"]["replicas"] >= 2


def test_k8s_redis_bounds_its_memory_with_lru_and_services_select_their_pods():
    docs = _replica_docs()
    redis = _container(docs[("Deployment", "vitserve-redis")]["spec"]["template"]["spec"], "redis")
    command = " ".join(redis["args"])
    assert "--maxmemory-policy allkeys-lru" in command
    assert "--maxmemory " in command
    assert "--requirepass" in command
    for name in ("vitserve-redis", "vitserve-replicas"):
        labels = docs[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
        selector = docs[("Service", name)]["spec"]["selector"]
        assert selector.items() <= labels.items()
    url = "redis://:pw@vitserve-redis:6379/0"  # the Secret's form in docs/scaling.md
    assert docs[("Service", "vitserve-redis")]["spec"]["ports"][0]["port"] == int(
        url.rsplit(":", 1)[1].split("/")[0]
    )


def test_scaling_doc_points_at_the_replicas_manifest():
    text = (ROOT / "docs" / "scaling.md").read_text()
    assert "deploy/k8s/vitserve-replicas.yaml" in text
    assert "allkeys-lru" in text


def test_compose_vllm_ec_shares_the_directory_between_producer_and_consumer():
    """docker/compose.vllm-ec.yaml (docs/vllm.md, "The encoder-cache hand-over"): vLLM is an EC consumer of
    the directory vitserve writes (--ec_storage_path), both mount the one volume there, and vLLM publishes no
    port (a client that reaches it could kill its engine with a uuid)."""
    compose = yaml.safe_load((ROOT / "docker" / "compose.vllm-ec.yaml").read_text())
    vllm, vitserve = compose["services"]["vllm"], compose["services"]["vitserve"]
    config = build_config(vitserve["command"], {})
    assert config.llm_transport == "ec_storage"
    assert config.llm_url == "http://vllm:8000"
    (ec,) = [a.split("=", 1)[1] for a in vllm["command"] if a.startswith("--ec-transfer-config=")]
    ec = json.loads(ec)
    assert ec["ec_connector"] == "ECExampleConnector"
    assert ec["ec_role"] == "ec_consumer"
    assert ec["ec_connector_extra_config"]["shared_storage_path"] == config.ec_storage_path
    mounts = [f"{v}:{config.ec_storage_path}" for v in compose["volumes"]]
    assert set(mounts) <= set(vllm["volumes"]) & set(vitserve["volumes"])
    assert "ports" not in vllm
    assert not any(a.startswith("--media-io-kwargs") for a in vllm["command"])  # it would change every uuid
    inline = yaml.safe_load((ROOT / "docker" / "compose.vllm.yaml").read_text())["services"]["vitserve"]
    assert vitserve["build"] == inline["build"]
    assert vitserve["stop_grace_period"] == inline["stop_grace_period"]
