"""vitserve's own vLLM encoder-cache connector (vitserve/connector/glue.py, docs/vllm.md) loaded by module path
into a real vLLM: tests/vllm/connector_server.py's one more vLLM server, Qwen3-VL (DeepStack, its tower kept),
vitserve on its path as its package alone, the connector's port on loopback TCP with a key file.
The pushes here come from raw DEALER sockets keyed with rpc/wirekey.py, so that a refusal (nack) and a
missing reply can be read as they are.

Each request that names a pushed tensor announces it in `ec_transfer_params` (docs/wire.md, "The announcement"),
as vitserve does. A correct push gives vLLM's own answer for the raw image (identical tokens, logprobs within
1e-4: the tensor is what transformers' tower computes from the same pixels, an image whose size needs no
resize), with vLLM's shared-memory processor cache on; everything else (an unknown uuid, a held tensor the
request does not announce, too few rows, a stranger without the key, garbage, a vanished sender, a full bound)
ends in a refusal or an error answer, vLLM's /health stays 200 and the next request is answered.
tests/vllm/test_connector_limits.py has the hostile peers, the full device, the metrics and protected mode.
"""

from __future__ import annotations

import io
import os
import socket
import time
import uuid as uuidlib

import httpx
import msgpack
import pytest
import torch
import zmq
from PIL import Image

from tests.checkpoints import hf_reference
from tests.openai_chat import assert_same_answer, chat_request, complete, image_url_part
from tests.vllm.connector_server import FAMILY, SECRET
from tests.vllm.stack import png
from vitserve.rpc import wirekey
from vitserve.rpc.replies import Ack, Held, Nack, decode_reply, encode_holds
from vitserve.rpc.wire import ImageEmbedding, encode_embedding_message

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
REPLY_S = 30.0  # a reply that must come (generous for a loaded machine); a refused peer's wait is 2 s
WIDTH = 192  # the model's: 64 main columns and 2 DeepStack levels of 64 (tests/checkpoints.py)


@pytest.fixture(scope="module")
def consumer(connector_vllm):
    """(checkpoint, the connector's endpoint, the vLLM server): tests/vllm/connector_server.py's, shared."""
    return connector_vllm.ckpt, connector_vllm.endpoint, connector_vllm.server


def _socket(key: bytes | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if key is not None:
        wirekey.configure_client(sock, key)
    return sock


def _send(endpoint: str, frames: list, key: bytes | None = SECRET, wait_s: float = REPLY_S):
    """Send one message from a fresh DEALER; the reply (decoded), or None if none came within wait_s."""
    with _socket(key) as sock:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        if not sock.poll(int(wait_s * 1000)):
            return None
        return decode_reply(sock.recv())


def _release(endpoint: str, uuids) -> None:
    """Tell the connector that request "r" (every message here) will not load `uuids`, as vitserve does for a
    failed request: what a test pushed and did not load is evictable at once instead of filling the small
    tmpfs until its expiry. A holds query on the same connection follows: its reply says the release was taken."""
    with _socket(SECRET) as sock:
        sock.connect(endpoint)
        sock.send(msgpack.packb({"v": 3, "release": list(uuids), "request_id": "r"}))
        sock.send(encode_holds([_new_uuid()], "q-release"))  # not those: a holds reply would promise them
        assert sock.poll(int(REPLY_S * 1000))
        sock.recv()


def _embedding(ckpt, image: bytes) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """transformers' tower on the image's pixels: (main rows, DeepStack levels, grid)."""
    from transformers import AutoImageProcessor

    processed = AutoImageProcessor.from_pretrained(str(ckpt))(
        images=Image.open(io.BytesIO(image)).convert("RGB"), return_tensors="pt"
    )
    embeds, deepstack = hf_reference(ckpt, FAMILY)(processed["pixel_values"], processed["image_grid_thw"])
    return embeds, deepstack, processed["image_grid_thw"][0].tolist()


def _message(uuid: str, embeds, deepstack, grid) -> list:
    return encode_embedding_message(
        ImageEmbedding(
            request_id="r",
            image_index=0,
            num_images=1,
            image_id="0" * 64,
            grid_thw=tuple(grid),
            embedding=embeds,
            deepstack=deepstack,
            expires_at=time.time() + 120,
            uuid=uuid,
        )
    )


def _zeros(rows: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A tensor of the model's width: 64 main columns and 2 DeepStack levels of 64 (tests/checkpoints.py)."""
    return torch.zeros(rows, 64), [torch.zeros(rows, 64)] * 2


def _part(uuid: str, grid) -> dict:
    return {"type": "image_embeds", "image_embeds": {"image_grid_thw": list(grid)}, "uuid": uuid}


def _announced(body: dict, items: dict[str, int], width: int = WIDTH, dtype: str = "float32") -> dict:
    """`body` announcing uuid -> rows as vitserve does (docs/wire.md, "The announcement")."""
    announced = {uuid: {"rows": rows, "width": width, "dtype": dtype} for uuid, rows in items.items()}
    return {**body, "ec_transfer_params": {"vitserve": {"v": 1, "items": announced}}}


def _request(ckpt, uuid: str, grid, **kwargs) -> dict:
    """A chat request naming `uuid` metadata-only, announced with the rows of `grid`."""
    rows = grid[0] * grid[1] * grid[2] // 4
    return _announced(chat_request(str(ckpt), _part(uuid, grid), **kwargs), {uuid: rows})


def _new_uuid() -> str:
    return uuidlib.uuid4().hex * 2


def _assert_error_then_healthy(ckpt, server, body: dict) -> None:
    """`body` is answered with an error; vLLM stays healthy and answers the next request."""
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code >= 400, r.text
    assert "error" in r.json(), r.text
    assert server.alive()
    complete(server.url, {**chat_request(str(ckpt), image_url_part(png(64, 64, seed=9))), "max_tokens": 2})
    assert server.alive()


@pytest.fixture(scope="module")
def pushed(consumer):
    """One image pushed (acknowledged), its uuid, grid and raw bytes."""
    ckpt, endpoint, _ = consumer
    image = png(128, 96, seed=31)  # a multiple of patch x merge (32 px): no resize, so the pixels agree
    embeds, deepstack, grid = _embedding(ckpt, image)
    uuid = _new_uuid()
    frames = _message(uuid, embeds, deepstack, grid)
    reply = _send(endpoint, frames)
    assert reply == Ack(msgpack.unpackb(frames[0])["message_id"])
    return uuid, grid, image


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_pushed_image_gives_vllms_own_answer(consumer, pushed, stream):
    ckpt, endpoint, server = consumer
    uuid, grid, image = pushed
    given = complete(server.url, _request(ckpt, uuid, grid, stream=stream))
    own = complete(server.url, chat_request(str(ckpt), image_url_part(image), stream=stream))  # via shm cache
    assert_same_answer(own, given)
    held = _send(endpoint, [encode_holds([uuid, _new_uuid()], "q-1")])
    assert held == Held("q-1", (uuid,))  # still held after its load: a repeat need not be pushed again


def test_an_unknown_uuid_is_an_error_and_vllm_stays_healthy(consumer):
    ckpt, _, server = consumer
    _assert_error_then_healthy(ckpt, server, _request(ckpt, _new_uuid(), [1, 6, 8]))  # announced, never came
    _assert_error_then_healthy(ckpt, server, chat_request(str(ckpt), _part(_new_uuid(), [1, 6, 8])))


def test_a_held_tensor_is_loaded_only_for_a_request_that_announces_it(consumer, pushed):
    """A direct request naming a held uuid without announcing it fails (vLLM has nothing else to encode it
    from); a raw image whose client-set uuid is a held one is vLLM's own to encode, the held tensor unused."""
    ckpt, endpoint, server = consumer
    uuid, grid, image = pushed
    _assert_error_then_healthy(ckpt, server, chat_request(str(ckpt), _part(uuid, grid)))
    zeros = _new_uuid()
    assert isinstance(_send(endpoint, _message(zeros, *_zeros(12), grid)), Ack)
    raw = chat_request(str(ckpt), image_url_part(image))
    own = complete(server.url, raw)
    claimed = chat_request(str(ckpt), {**image_url_part(image), "uuid": zeros})
    assert_same_answer(own, complete(server.url, claimed))  # not the zeros held under that uuid
    assert server.alive()
    _release(endpoint, [zeros])


@pytest.mark.parametrize(
    "params",
    [
        {"vitserve": {"v": 2, "items": {}}},
        {"vitserve": {"v": 1, "items": {"u": {"rows": "12", "width": WIDTH, "dtype": "float32"}}}},
        {"vitserve": {"v": 1, "items": ["u"]}},
    ],
    ids=["version", "rows", "items"],
)
def test_a_malformed_announcement_fails_its_request_only(consumer, pushed, params):
    ckpt, _, server = consumer
    uuid, grid, _ = pushed
    _assert_error_then_healthy(ckpt, server, {**_request(ckpt, uuid, grid), "ec_transfer_params": params})


def test_too_few_rows_are_refused_and_a_grid_that_disagrees_fails_the_request(consumer, pushed):
    ckpt, endpoint, server = consumer
    uuid, grid, _ = pushed
    short = _new_uuid()
    reply = _send(endpoint, _message(short, *_zeros(5), grid))
    assert isinstance(reply, Nack)
    assert "rows" in reply.reason
    _assert_error_then_healthy(ckpt, server, _request(ckpt, short, grid))
    # a tensor held with the rows of its grid, named (and announced) with another grid: wrong rows
    _assert_error_then_healthy(ckpt, server, _request(ckpt, uuid, [1, 8, 8]))
    # announced with the rows of its placeholder but another width than the model's
    wide = _announced(chat_request(str(ckpt), _part(uuid, grid)), {uuid: 12}, width=WIDTH * 2)
    _assert_error_then_healthy(ckpt, server, wide)


def test_a_sender_without_the_key_gets_nothing_kept(consumer, pushed):
    ckpt, endpoint, server = consumer
    _, grid, image = pushed
    embeds, deepstack, _ = _embedding(ckpt, image)
    stranger = _new_uuid()
    for key in (None, b"not the secret, but 32 bytes ..."):
        assert _send(endpoint, _message(stranger, embeds, deepstack, grid), key=key, wait_s=2) is None
    assert _send(endpoint, [encode_holds([stranger], "q-2")]) == Held("q-2", ())
    _assert_error_then_healthy(ckpt, server, _request(ckpt, stranger, grid))


def test_garbage_on_the_connectors_port_changes_nothing(consumer, pushed):
    ckpt, endpoint, server = consumer
    uuid, grid, _ = pushed
    forged = msgpack.packb({"v": 3, "message_id": "m", "uuid": "../../etc"})
    for frames in ([b"\x00" * 100], [b"GET / HTTP/1.1\r\n\r\n", b"x"]):
        assert _send(endpoint, frames, wait_s=2) is None  # keyed peer, not the wire: skipped, not answered
    refused = _send(endpoint, [forged], wait_s=2)  # a bad message that names its id: refused by that id
    assert isinstance(refused, Nack)
    assert refused.reason.startswith("malformed: ")
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:  # a TCP peer that speaks no ZMTP
        raw.sendall(os.urandom(4096))
    assert server.alive()
    assert _send(endpoint, [encode_holds([uuid], "q-3")]) == Held("q-3", (uuid,))
    complete(server.url, {**_request(ckpt, uuid, grid), "max_tokens": 2})


def test_a_sender_that_vanishes_after_its_push_costs_nothing(consumer, pushed):
    ckpt, endpoint, server = consumer
    _, grid, image = pushed
    embeds, deepstack, _ = _embedding(ckpt, image)
    uuid = _new_uuid()
    sock = _socket(SECRET)
    sock.connect(endpoint)
    sock.send_multipart(_message(uuid, embeds, deepstack, grid))
    assert sock.poll(int(REPLY_S * 1000))
    sock.close(0)  # gone between the push and the request: the tensor is held, the request is answered
    given = complete(server.url, _request(ckpt, uuid, grid))
    assert given.tokens
    assert server.alive()


def test_a_push_over_the_memory_bound_is_refused(consumer):
    ckpt, endpoint, server = consumer
    big = _new_uuid()
    grid = [1, 20, 24]  # 120 rows x 192 floats = 90 KiB, over max_gb's ~52 KiB or the 80 KiB tmpfs
    reply = _send(endpoint, _message(big, *_zeros(120), grid))
    assert isinstance(reply, Nack)
    assert "bytes" in reply.reason  # the bound it is over, and its size
    _assert_error_then_healthy(ckpt, server, _request(ckpt, big, grid))
