"""deploy/compose.pull.yaml and deploy/nginx.pull.conf (issue 49 item 8): two vLLMs with vitserve's connector in
pull mode behind nginx, two vitserve replicas with --llm_transport pull. No Docker engine runs here, so these read
the files and hold them to what the code and the tests use: the producers each vitserve advertises are ones its
vLLMs' `pull_from` admits (the real Allowlist of vitserve/connector/fetch.py), both ends read the same key, vitserve
reaches vLLM through nginx, and nginx's upstreams and retry are those the tests run (tests/nginx_server.py).
tests/integration/test_nginx_server.py has real nginx check the config itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.nginx_server import RETRY
from vitserve.connector.allowlist import Allowlist
from vitserve.flags import build_config

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.pull.yaml"
NGINX = ROOT / "deploy" / "nginx.pull.conf"
KEY_PATH = "/run/secrets/vitserve-wire-key"


def services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def of_kind(kind: str) -> dict[str, dict]:
    return {name: s for name, s in services().items() if re.fullmatch(rf"{kind}-\d+", name)}


def flag(command: list[str], name: str) -> str:
    for i, arg in enumerate(command):
        if arg == name:
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} is not in {command}")


def extra_config(vllm: dict) -> dict:
    config = json.loads(flag(vllm["command"], "--ec-transfer-config"))
    assert config["ec_connector"] == "VitserveECConnector"
    assert config["ec_connector_module_path"] == "vitserve.vllm_connector"
    assert (ROOT / "vitserve" / "vllm_connector.py").is_file()
    assert config["ec_role"] == "ec_consumer"
    return config["ec_connector_extra_config"]


def test_two_engines_two_replicas_and_one_balancer():
    assert len(of_kind("vllm")) == 2
    assert len(of_kind("vitserve")) == 2
    assert "nginx" in services()


def test_every_replica_advertises_a_producer_that_every_engine_admits_with_the_same_key():
    replicas, engines = of_kind("vitserve"), of_kind("vllm")
    for name, replica in replicas.items():
        command = replica["command"]
        assert flag(command, "--llm_transport") == "pull"
        bind, advertise = flag(command, "--pull_bind"), flag(command, "--pull_advertise")
        assert bind.startswith("tcp://0.0.0.0:"), "a replica takes fetches from the engines on its network"
        assert advertise == f"tcp://{name}:{bind.rsplit(':', 1)[1]}", "its own service name, the bind's port"
        assert flag(command, "--wire_key_file") == KEY_PATH
        for engine in engines.values():
            extra = extra_config(engine)
            assert Allowlist(extra["pull_from"]).refuses(advertise) is None
            assert extra["key_file"] == KEY_PATH, "both ends read the one secret"
            assert "endpoint" not in extra, "pull binds nothing in vLLM"
            assert float(extra["wait_s"]) > 0
    for s in (*replicas.values(), *engines.values()):
        assert {"source": "wire-key", "target": Path(KEY_PATH).name} in s["secrets"]


def test_engines_load_the_connector_from_the_checkout_alone_on_their_path():
    for engine in of_kind("vllm").values():
        pkg = engine["environment"]["PYTHONPATH"]
        assert f"../vitserve:{pkg}/vitserve:ro" in engine["volumes"]
        assert engine["volumes"][0].rsplit(":", 2)[1] == "/model"


def test_replicas_reach_the_engines_through_nginx_whose_upstreams_are_the_engines():
    text = NGINX.read_text()
    listen = re.search(r"^\s*listen (\d+);", text, re.M)
    assert listen is not None
    for replica in of_kind("vitserve").values():
        assert flag(replica["command"], "--llm_url") == f"http://nginx:{listen.group(1)}"
        assert replica["depends_on"]["nginx"]["condition"] == "service_healthy"
    upstream = re.search(r"upstream vllm \{(.*?)\}", text, re.S)
    assert upstream is not None
    servers = re.findall(r"server (\S+?)(?: max_fails=0)?;", upstream.group(1))
    engines = {f"{name}:{flag(e['command'], '--port')}" for name, e in of_kind("vllm").items()}
    assert set(servers) == engines
    assert "./nginx.pull.conf:/etc/nginx/nginx.conf:ro" in services()["nginx"]["volumes"]
    assert "ports" not in services()["nginx"], "only the replicas reach vLLM"
    assert all("ports" not in e for e in of_kind("vllm").values())


def test_nginx_retries_as_the_tested_nginx_does():
    tested = [line.strip() for line in RETRY.format(tries=2).splitlines()]
    shipped = [line.strip() for line in NGINX.read_text().splitlines()]
    assert all(line in shipped for line in tested), f"deploy/nginx.pull.conf must carry {tested}"


def test_replica_flags_parse(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    for replica in of_kind("vitserve").values():
        argv = [str(key) if a == KEY_PATH else a for a in replica["command"]]
        argv = ["--model=demo" if a == "/model" else a for a in argv]
        argv = [a for a in argv if a != "--model"]
        config = build_config(argv, replica["environment"])
        assert config.llm_transport == "pull"
