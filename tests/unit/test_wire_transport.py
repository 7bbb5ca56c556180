"""--llm_transport wire, vitserve's side (handover/wire.py, rpc/sender.py, docs/vllm.md "vitserve's own
connector"): its flags and start-up refusals, the parts and messages it builds, and the sender's nack, holds
query and key against a real ZMQ ROUTER that speaks the connector's replies (rpc/replies.py). The real
connector in a real vLLM is tests/vllm/test_wire.py's subject; here the peer is a socket this test drives, so
each reply the connector can send is produced on purpose.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pytest
import torch
import zmq

from vitserve.config import Config
from vitserve.connector.keys import configure_server
from vitserve.contract import ItemResult, PreparedImage, ProcessedImage
from vitserve.errors import ConfigError, LLMTimeout
from vitserve.families import FAMILIES
from vitserve.flags import build_config
from vitserve.handover.base import Setup
from vitserve.handover.ec_files import ec_uuid
from vitserve.handover.embeds import EmbeddingMismatch, EmbedsLayout
from vitserve.handover.wire import ConnectorUnavailable, WireTransport
from vitserve.metrics import Metrics
from vitserve.rpc.replies import HoldsQuery, decode_inbound, encode_held, encode_nack
from vitserve.rpc.sender import LLMSender, WireRefused
from vitserve.rpc.wire import ImageEmbedding, encode_ack
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
    ],
)  # fmt: skip
def test_a_wire_setting_that_cannot_work_is_refused_naming_its_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        build_config(argv, {})


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

    def __init__(self, reply=None, secret: bytes | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.auth = configure_server(self.sock, secret) if secret is not None else None
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.reply = reply or self.keep
        self.received: list[ImageEmbedding | HoldsQuery] = []
        self.kept: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            inbound = decode_inbound(frames)
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
