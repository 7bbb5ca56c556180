"""vitserve's vLLM connector at its limits, in the session's Qwen3-VL connector vLLM
(tests/vllm/connector_server.py: its tensors on an 80 KiB tmpfs, max_gb far larger, vLLM's shared-memory
processor cache on): hostile but well-formed messages from a keyed peer, a device too small for what is pushed,
its counters in vLLM's own /metrics, and protected mode refusing a keyless connector on 0.0.0.0.

After each hostile message a reply comes (an ack or a nack: the receiver took it and lives), and a fresh image
pushed after it gives vLLM's own answer for the raw image; vLLM stays healthy throughout.
"""

from __future__ import annotations

import errno
import textwrap
import time
from pathlib import Path

import httpx
import msgpack
import pytest

from tests.openai_chat import assert_same_answer, chat_request, complete, image_url_part
from tests.vllm.connector_server import start_glue
from tests.vllm.stack import metric, png
from tests.vllm.test_connector import (
    _announced,
    _embedding,
    _message,
    _new_uuid,
    _part,
    _release,
    _request,
    _send,
    _zeros,
)
from vitserve.rpc.replies import Ack, Nack
from vitserve.rpc.wire import ImageEmbedding, encode_embedding_message

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def consumer(connector_vllm):
    connector_vllm.server.wait_ready()
    return connector_vllm


@pytest.fixture(scope="module")
def fresh(consumer):
    """An image whose tensors can be pushed again and again under fresh uuids, and vLLM's own answer for it."""
    image = png(128, 96, seed=41)  # no resize: the pixels agree
    embeds, deepstack, grid = _embedding(consumer.ckpt, image)
    own = complete(consumer.server.url, chat_request(str(consumer.ckpt), image_url_part(image)))
    return embeds, deepstack, grid, own


def _assert_a_fresh_push_is_answered_as_vllms_own(consumer, fresh) -> None:
    embeds, deepstack, grid, own = fresh
    uuid = _new_uuid()
    assert isinstance(_send(consumer.endpoint, _message(uuid, embeds, deepstack, grid)), Ack)
    assert_same_answer(own, complete(consumer.server.url, _request(consumer.ckpt, uuid, grid)))
    assert consumer.server.alive()


def _hostile(uuid: str, rows: int = 12, grid=(1, 6, 8), message_id: str = "") -> list:
    embeds, deepstack = _zeros(rows)
    message = ImageEmbedding(
        request_id="r",
        image_index=0,
        num_images=1,
        image_id="0" * 64,
        grid_thw=grid,
        embedding=embeds,
        deepstack=deepstack,
        expires_at=time.time() + 60,
        uuid=uuid,
        message_id=message_id,
    )
    return encode_embedding_message(message)


def _zero_rows(uuid: str) -> list:
    """A message of grid [1, 0, 0] and 0 rows: well-formed, but vitserve's own encoder cannot make it (an empty
    tensor has no buffer to send), so its header is rewritten from a 1-row one and its tensor frames are empty."""
    frames = _hostile(uuid, rows=1, grid=(1, 2, 2))
    header = msgpack.unpackb(frames[0])
    header.update(grid_thw=[1, 0, 0], num_tokens=0, shape=[0, 64], deepstack_shapes=[[0, 64], [0, 64]])
    return [msgpack.packb(header), b"", b"", b""]


HOSTILE = {
    "zero_rows": lambda: _zero_rows(_new_uuid()),
    "uuid_dot": lambda: _hostile("."),
    "message_id_slash": lambda: _hostile(_new_uuid(), message_id="a/../b"),
    "uuid_246": lambda: _hostile("u" * 246),
    "uuid_250": lambda: _hostile("v" * 250),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_well_formed_message_is_answered_and_the_next_push_works(consumer, fresh, name):
    frames = HOSTILE[name]()
    reply = _send(consumer.endpoint, frames)
    assert isinstance(reply, Ack | Nack), f"no reply to {name}: the receiver did not take it"
    if isinstance(reply, Ack):  # kept: let it go, or it fills the small tmpfs until its expiry
        _release(consumer.endpoint, [msgpack.unpackb(frames[0])["uuid"]])
    _assert_a_fresh_push_is_answered_as_vllms_own(consumer, fresh)


@pytest.fixture
def shm(consumer) -> Path:
    if not consumer.shm_mounted:
        pytest.skip("no tmpfs for the connector's shm_dir (mount -t tmpfs was refused: not root?)")
    return consumer.shm_dir


def test_images_that_do_not_fit_the_device_are_refused_and_the_next_request_is_answered(consumer, fresh, shm):
    """28-row tensors (21 KiB, 6 pages each) pushed for one request onto the 80 KiB tmpfs, none loaded yet: four
    cannot all fit, so one is refused with a nack, not a hang (whatever earlier tests left there). The ones
    acknowledged are then loaded by the request that announces them, and a fresh image fits again."""
    grid = (1, 8, 14)  # 28 rows
    replies = {}
    for _ in range(4):
        uuid = _new_uuid()
        replies[uuid] = _send(consumer.endpoint, _message(uuid, *_zeros(28), grid))
        assert replies[uuid] is not None, "no reply: the receiver did not take it"
        if isinstance(replies[uuid], Nack):
            break
    assert isinstance(replies[uuid], Nack), replies
    kept = [u for u, reply in replies.items() if isinstance(reply, Ack)]
    if kept:
        body = chat_request(str(consumer.ckpt), _part(kept[0], grid))
        body["messages"][0]["content"][1:1] = [_part(u, grid) for u in kept[1:]]
        complete(consumer.server.url, {**_announced(body, dict.fromkeys(kept, 28)), "max_tokens": 2})
    _assert_a_fresh_push_is_answered_as_vllms_own(consumer, fresh)


def test_a_full_device_is_a_reply_not_a_hang(consumer, fresh, shm):
    """The device filled by someone else (ENOSPC whatever the bound says): a push is answered (a nack, or an
    ack when evicting spent tensors made room), and once there is room again a fresh image is answered."""
    filler, uuid = shm / "filler", _new_uuid()
    try:
        _fill(filler)
        reply = _send(consumer.endpoint, _message(uuid, *_zeros(12), (1, 6, 8)))
        assert isinstance(reply, Ack | Nack), "no reply with the device full"
    finally:
        filler.unlink(missing_ok=True)
    _release(consumer.endpoint, [uuid])
    _assert_a_fresh_push_is_answered_as_vllms_own(consumer, fresh)


def _fill(path: Path) -> None:
    """Write `path` until its device says it is full."""
    with pytest.raises(OSError, match="No space left") as full, open(path, "wb", buffering=0) as f:  # noqa: PT012
        while True:
            f.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC, full.value


COUNTED = (RECEIVED, SUPPLIED, REFUSED, FAILED) = (
    "vllm:vitserve_connector_received_total",
    "vllm:vitserve_connector_supplied_total",
    "vllm:vitserve_connector_refused_total",
    "vllm:vitserve_connector_requests_failed_total",
)


def test_the_connectors_counters_are_in_vllms_metrics(consumer, fresh):
    """A refused push, a request failed for an item it does not announce, a push and its request: each moves
    its counter in vLLM's /metrics (vLLM reports a step's stats with the step's outputs)."""
    ckpt, url = consumer.ckpt, consumer.server.url
    before = {name: metric(url, name) for name in COUNTED}
    assert isinstance(_send(consumer.endpoint, _message(_new_uuid(), *_zeros(5), (1, 6, 8))), Nack)
    failed = httpx.post(
        url + "/v1/chat/completions", json=chat_request(str(ckpt), _part(_new_uuid(), (1, 6, 8)))
    )
    assert failed.status_code >= 400
    _assert_a_fresh_push_is_answered_as_vllms_own(consumer, fresh)
    after = {name: metric(url, name) for name in COUNTED}
    assert all(after[name] >= before[name] + 1 for name in COUNTED), (before, after)
    assert metric(url, FAILED, reason="unannounced") >= 1
    assert metric(url, "vllm:vitserve_connector_held_bytes") > 0


PROTECTED = textwrap.dedent(
    """
    import logging, sys, types
    import vitserve.vllm_connector as module
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    logging.basicConfig(level=logging.WARNING)

    def config(extra):
        ec = types.SimpleNamespace(ec_connector_extra_config=extra, is_ec_producer=False, is_ec_consumer=True)
        model = types.SimpleNamespace(
            dtype="float32",
            hf_config=types.SimpleNamespace(vision_config=None),
            get_hidden_size=lambda: 64,
        )
        parallel = types.SimpleNamespace(data_parallel_index=0, data_parallel_size=1)
        return types.SimpleNamespace(ec_transfer_config=ec, model_config=model, parallel_config=parallel)

    extra = {"endpoint": "tcp://0.0.0.0:0", "shm_dir": sys.argv[1]}
    try:
        module.VitserveECConnector(config(extra), ECConnectorRole.SCHEDULER)
    except ValueError as exc:
        print("REFUSED", exc, flush=True)
    connector = module.VitserveECConnector(config({**extra, "allow_unauthenticated": True}), ECConnectorRole.SCHEDULER)
    print("BOUND", connector.store.endpoint, flush=True)
    connector.shutdown()
    """
)


def test_a_keyless_connector_on_all_interfaces_is_refused_unless_allowed(tmp_path):
    """The glue's own start (config, store) in a fresh interpreter of vLLM's venv, vitserve's package alone on
    its path, as vLLM's engine core runs it; not a whole vLLM start-up (a minute of the suite's two cores)."""
    out = start_glue(tmp_path, PROTECTED)
    refused = [line for line in out.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 1, out.stdout
    assert "tcp://0.0.0.0:0" in refused[0]
    assert "allow_unauthenticated" in refused[0]
    assert "key_file" in refused[0]
    assert "BOUND tcp://0.0.0.0:" in out.stdout
    said = [line for line in (out.stdout + out.stderr).splitlines() if "WARNING" in line]
    assert any("allow_unauthenticated" in line for line in said), out.stderr[-3000:]  # allowed, said at start
