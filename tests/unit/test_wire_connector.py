"""The wire's messages for vitserve's vLLM connector (docs/wire.md, "vitserve's vLLM connector"): the header's
`uuid`, refusals, holds queries and answers (rpc/replies.py), and the shared key (rpc/wirekey.py) over real
ZMQ CURVE sockets."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from vitserve.connector import keys
from vitserve.rpc import wirekey
from vitserve.rpc.replies import (
    Ack,
    Held,
    HoldsQuery,
    Nack,
    Release,
    decode_inbound,
    decode_reply,
    encode_held,
    encode_holds,
    encode_nack,
    encode_release,
    message_id_of,
)
from vitserve.rpc.wire import (
    ImageEmbedding,
    WireError,
    decode_ack,
    decode_embedding_message,
    encode_ack,
    encode_embedding_message,
)

UUID = "0f" * 32


def message(**over) -> ImageEmbedding:
    fields = {
        "request_id": "r",
        "image_index": 0,
        "num_images": 1,
        "image_id": "ab" * 32,
        "grid_thw": (1, 4, 4),
        "embedding": torch.arange(32.0).reshape(4, 8),
        "deepstack": [torch.ones(4, 8)],
        "expires_at": 1.9e9,
        "uuid": UUID,
    }
    return ImageEmbedding(**{**fields, **over})


def test_the_uuid_travels_in_the_header_and_is_optional():
    frames = encode_embedding_message(message())
    assert msgpack.unpackb(frames[0])["uuid"] == UUID
    decoded = decode_embedding_message(frames)
    assert decoded.uuid == UUID
    assert torch.equal(decoded.deepstack[0], torch.ones(4, 8))
    assert decode_embedding_message(encode_embedding_message(message(uuid=None))).uuid is None
    assert decode_inbound(frames).uuid == UUID


@pytest.mark.parametrize("good", ["a/b", "..", "x" * 256, "ab..cd", "é日本", "lora:x/../y"])
def test_any_string_vllm_takes_as_a_cache_key_travels(good):
    assert decode_embedding_message(encode_embedding_message(message(uuid=good))).uuid == good


@pytest.mark.parametrize("bad", ["", "x" * 257, 7, None.__class__.__name__.encode()])
def test_a_uuid_that_is_no_string_or_too_long_is_refused_both_ways(bad):
    with pytest.raises(WireError, match="uuid"):
        encode_embedding_message(message(uuid=bad))
    header = msgpack.unpackb(encode_embedding_message(message())[0])
    frames = encode_embedding_message(message())
    frames[0] = msgpack.packb({**header, "uuid": bad})
    with pytest.raises(WireError, match="uuid"):
        decode_embedding_message(frames)


def test_replies_round_trip():
    assert decode_reply(encode_ack("m-1")) == Ack("m-1")
    assert decode_reply(encode_nack("m-2", "over max_gb")) == Nack("m-2", "over max_gb")
    assert decode_reply(encode_held([UUID], "q-1")) == Held("q-1", (UUID,))
    assert decode_reply(encode_held([], "q-2")) == Held("q-2", ())
    assert decode_ack(encode_ack("m-1")) == "m-1"  # the v3 acknowledgement is unchanged
    with pytest.raises(WireError):
        decode_ack(encode_nack("m-2", "no"))  # a v3 sender that knows no refusal logs it, never misreads it


def test_a_holds_query_round_trips_and_is_checked():
    query = encode_holds([UUID, "1" * 64], "q-1", expires_at=time.time() + 5)
    decoded = decode_inbound([query])
    assert isinstance(decoded, HoldsQuery)
    assert decoded.uuids == (UUID, "1" * 64)
    assert decoded.query_id == "q-1"
    assert decoded.expires_at > time.time()
    assert decode_inbound([encode_holds([UUID], "q-2")]).expires_at is None
    for bad in (
        {"holds": ["x" * 257]},
        {"holds": UUID},
        {"holds": [UUID] * 1025},
        {"holds": [], "query_id": ""},
    ):
        with pytest.raises(WireError):
            decode_inbound([msgpack.packb({"v": 3, "query_id": "q", **bad})])
    with pytest.raises(WireError, match="version"):
        decode_inbound([msgpack.packb({"v": 2, "holds": [], "query_id": "q"})])


def test_a_release_round_trips_and_is_checked():
    assert decode_inbound([encode_release("req-1", [UUID, "1" * 64])]) == Release("req-1", (UUID, "1" * 64))
    assert decode_inbound([encode_release("", [])]) == Release("", ())
    for bad in (
        {"release": ["x" * 257]},
        {"release": UUID},
        {"release": [UUID] * 1025},
        {"request_id": "r" * 257},
    ):
        with pytest.raises(WireError):
            decode_inbound([msgpack.packb({"v": 3, "release": [UUID], "request_id": "r", **bad})])
    with pytest.raises(WireError):
        encode_release("r", ["x" * 257])  # the sender refuses what the connector would reject


def test_a_malformed_messages_id_is_read_to_refuse_it_by_name():
    header = msgpack.unpackb(encode_embedding_message(message())[0])
    assert message_id_of([msgpack.packb({**header, "uuid": "a/b"})]) == header["message_id"]
    assert message_id_of([msgpack.packb({**header, "message_id": 7})]) is None
    assert message_id_of([b"\xc1"]) is None
    assert message_id_of([]) is None


@pytest.mark.parametrize(
    "frames",
    [[b"\xc1"], [b"garbage", b"more"], [msgpack.packb([1, 2])], [msgpack.packb({"v": 3})], []],
    ids=["not-msgpack", "two-garbage", "a-list", "no-fields", "empty"],
)
def test_garbage_inbound_is_a_wire_error(frames):
    with pytest.raises(WireError):
        decode_inbound(frames)


@pytest.mark.parametrize(
    "frame",
    [b"", msgpack.packb({"v": 3}), msgpack.packb({"v": 3, "nack": "m"}), msgpack.packb({"v": 3, "held": 1})],
)
def test_a_malformed_reply_is_a_wire_error(frame):
    with pytest.raises(WireError):
        decode_reply(frame)


def test_the_key_file_needs_a_real_secret(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(b"  short\n")
    with pytest.raises(ValueError, match="secret"):
        wirekey.read_key_file(path)
    path.write_bytes(b"s" * 32 + b"\n")
    assert wirekey.read_key_file(path) == b"s" * 32
    server, client = wirekey.keypair(b"s" * 32, "server"), wirekey.keypair(b"s" * 32, "client")
    assert server != client
    assert server == wirekey.keypair(b"s" * 32, "server")


def _exchange(server_secret: bytes, client_secret: bytes | None) -> bytes | None:
    """One message from a DEALER (keyed with client_secret, or plain) to a CURVE ROUTER; what arrived."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    auth = keys.configure_server(router, server_secret)
    dealer = ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        if client_secret is not None:
            wirekey.configure_client(dealer, client_secret)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        if router.poll(1000):  # a refused handshake never delivers: 1 s is the wait for what never comes
            return router.recv_multipart()[1]
        return None
    finally:
        dealer.close(0)
        router.close(0)
        auth.stop()
        ctx.term()


def test_only_a_peer_with_the_secret_gets_through():
    secret = b"k" * 32
    assert _exchange(secret, secret) == b"hello"
    assert _exchange(secret, b"x" * 32) is None
    assert _exchange(secret, None) is None
