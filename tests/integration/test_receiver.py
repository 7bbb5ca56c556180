"""LLMSender -> EmbeddingReceiver over real ZMQ sockets (tcp://127.0.0.1 and ipc://), docs/integration.md."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import threading
import time

import msgpack
import pytest
import torch
import zmq

from vitserve.errors import ConfigError, Timeout
from vitserve.rpc import EmbeddingReceiver, ImageEmbedding, LLMSender, encode_embedding_message


@pytest.fixture
def short_dir():
    # ipc:// paths must fit in sun_path (~107 bytes); pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="vs-rpc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["tcp", "ipc"])
def receiver(request, short_dir):
    endpoint = "tcp://127.0.0.1:*" if request.param == "tcp" else f"ipc://{short_dir}/llm.sock"
    with EmbeddingReceiver(endpoint) as rx:
        yield rx


def far() -> float:
    return time.monotonic() + 30.0


def send(sender, *, request_id="r", image_index=0, num_images=1, embedding=None, deepstack=(), deadline=None):
    if embedding is None:
        embedding = torch.full((4, 8), float(image_index))
    return sender.send_embedding(
        request_id=request_id,
        image_index=image_index,
        num_images=num_images,
        image_id=f"{request_id}-{image_index}",
        model="tiny",
        grid_thw=(1, 4, 4),
        embedding=embedding,
        deepstack=deepstack,
        deadline=far() if deadline is None else deadline,
    )


def send_until_timeout(sender, limit: int, **kwargs) -> tuple[int, Timeout | None]:
    """Send numbered images until one raises Timeout; returns (sent successfully, that Timeout)."""
    for i in range(limit):
        try:
            send(sender, image_index=i, num_images=limit, deadline=time.monotonic() + 0.3, **kwargs)
        except Timeout as exc:
            return i, exc
    return limit, None


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_with_deepstack_is_byte_identical(receiver, dtype):
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(100, 64, generator=g).to(dtype)
    deep = [torch.randn(100, 64, generator=g).to(dtype) for _ in range(3)]
    with LLMSender(receiver.endpoint) as tx:
        nbytes = send(tx, request_id="r-7", image_index=2, num_images=5, embedding=emb, deepstack=deep)
        msg = receiver.recv(timeout_s=10)
    assert isinstance(msg, ImageEmbedding)
    assert (msg.request_id, msg.image_index, msg.num_images, msg.image_id) == ("r-7", 2, 5, "r-7-2")
    assert (msg.model, msg.grid_thw, msg.num_tokens) == ("tiny", (1, 4, 4), 100)
    assert raw(msg.embedding) == raw(emb)
    assert msg.embedding.dtype == dtype
    assert [raw(d) for d in msg.deepstack] == [raw(d) for d in deep]
    assert nbytes > 4 * emb.numel() * emb.element_size()
    assert tx.bytes_sent == nbytes
    assert tx.messages_sent == 1


def test_sender_connected_before_the_receiver_binds_still_delivers(short_dir):
    endpoint = f"ipc://{short_dir}/late.sock"
    with LLMSender(endpoint) as tx:
        send(tx, image_index=0)  # queued in ZMQ: nobody has bound yet
        with EmbeddingReceiver(endpoint) as rx:
            assert rx.recv(timeout_s=10).image_index == 0


def check_each_once_in_order(got: list[ImageEmbedding], requests: int, images: int) -> None:
    keys = [(m.request_id, m.image_index) for m in got]
    assert len(set(keys)) == len(keys) == requests * images
    for m in got:
        t, r = (int(x[1:]) for x in m.request_id.split("-"))
        assert torch.equal(m.embedding, torch.full((3, 5), float(t * 1000 + r * 10 + m.image_index)))
    by_request: dict[str, list[int]] = {}
    for m in got:
        by_request.setdefault(m.request_id, []).append(m.image_index)
    assert all(order == list(range(images)) for order in by_request.values())


@pytest.mark.parametrize("shared_sender", [True, False])
def test_concurrent_senders_deliver_each_message_once_in_request_order(receiver, shared_sender):
    threads_n, requests_per_thread, images = 4, 3, 5
    shared = LLMSender(receiver.endpoint) if shared_sender else None
    errors: list[BaseException] = []
    drained = threading.Event()

    def worker(t: int) -> None:
        tx = shared or LLMSender(receiver.endpoint)
        try:
            for r in range(requests_per_thread):
                for i in range(images):
                    send(tx, request_id=f"t{t}-r{r}", image_index=i, num_images=images,
                         embedding=torch.full((3, 5), float(t * 1000 + r * 10 + i)))  # fmt: skip
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)
        finally:
            # Close only after everything was received: closing while the receiver sits at its HWM
            # can lose the queued tail in libzmq (see LLMSender.close); vitserve closes at shutdown.
            drained.wait(timeout=60)
            if shared is None:
                tx.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    try:
        got = [receiver.recv(timeout_s=10) for _ in range(threads_n * requests_per_thread * images)]
    finally:
        drained.set()
    for th in threads:
        th.join()
    if shared is not None:
        shared.close()
    assert errors == []
    check_each_once_in_order(got, threads_n * requests_per_thread, images)
    with pytest.raises(TimeoutError):
        receiver.recv(timeout_s=0.2)  # nothing extra, nothing duplicated


class _Exploit:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))  # would run on unpickling


def test_bad_messages_are_logged_and_skipped(receiver, tmp_path, caplog):
    marker = tmp_path / "pwned"
    secret = b"SECRET-PAYLOAD-BYTES"
    good = encode_embedding_message(
        request_id="good", image_index=0, num_images=1, image_id="x", model="m", grid_thw=(1, 2, 2),
        embedding=torch.ones(2, 4),
    )  # fmt: skip
    header = msgpack.unpackb(good[0])
    bad_messages = [
        [secret],
        [secret, secret, secret],
        [pickle.dumps(_Exploit(str(marker)))],
        [pickle.dumps(_Exploit(str(marker))), secret],
        [pickle.dumps(_Exploit(str(marker))), *good[1:]],
        [msgpack.packb({**header, "v": 2}), *good[1:]],  # unknown version
        [good[0], secret],  # size does not match dtype x shape
        [good[0], good[1], secret],  # a frame the header does not announce
        [msgpack.packb({**header, "num_tokens": 3}), *good[1:]],
    ]
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.connect(receiver.endpoint)
    try:
        with caplog.at_level(logging.ERROR, logger="vitserve.rpc.receiver"):
            for frames in bad_messages:
                push.send_multipart(frames)
            push.send_multipart(good)
            msg = receiver.recv(timeout_s=10)
    finally:
        push.close(linger=0)
    assert msg.request_id == "good"
    assert torch.equal(msg.embedding, torch.ones(2, 4))
    assert receiver.rejected == len(bad_messages)
    assert receiver.received == 1
    assert not marker.exists(), "a pickle payload was unpickled"
    rejected = [r for r in caplog.records if "rejected a message" in r.getMessage()]
    assert len(rejected) == len(bad_messages)
    assert "unknown wire version 2" in caplog.text
    assert "SECRET" not in caplog.text, "payload bytes leaked into the log"


def test_frame_over_max_frame_bytes_is_refused_and_receiving_goes_on():
    with EmbeddingReceiver("tcp://127.0.0.1:*", max_frame_bytes=4096) as rx, LLMSender(rx.endpoint) as tx:
        send(tx, request_id="huge", embedding=torch.zeros(64, 64))  # 16 KiB frame: peer disconnected
        with pytest.raises(TimeoutError):
            rx.recv(timeout_s=0.5)
        send(tx, request_id="small")  # ZMQ reconnects on its own
        assert rx.recv(timeout_s=10).request_id == "small"


def test_close_ends_a_recv_waiting_forever(short_dir):
    rx = EmbeddingReceiver(f"ipc://{short_dir}/close.sock")
    outcome: list[BaseException] = []

    def wait_forever() -> None:
        try:
            rx.recv()
        except BaseException as exc:
            outcome.append(exc)

    th = threading.Thread(target=wait_forever)
    th.start()
    time.sleep(0.3)  # let it block in recv(); not an assertion on timing
    rx.close()
    th.join(timeout=30)
    assert not th.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], RuntimeError)


def test_recv_times_out_when_nothing_arrives(receiver):
    with pytest.raises(TimeoutError, match="within 0.1 s"):
        receiver.recv(timeout_s=0.1)


def test_slow_receiver_blocks_sender_then_timeout_and_nothing_is_lost(short_dir):
    endpoint = f"ipc://{short_dir}/slow.sock"
    big = torch.zeros(1024, 1024)  # 4 MiB a message: the kernel's socket buffers fill after a few
    with EmbeddingReceiver(endpoint, rcvhwm=1) as rx, LLMSender(endpoint, sndhwm=1, linger_s=0.5) as tx:
        # far more messages than the HWMs and socket buffers can hold
        sent, timeout = send_until_timeout(tx, 200, request_id="slow", embedding=big)
        assert timeout is not None
        assert timeout.status == 504
        assert "--llm_endpoint" in timeout.message
        assert 0 < sent < 200
        assert tx.messages_sent == sent
        # The LLM server catches up: exactly the accepted messages arrive, once each, in order.
        received = [rx.recv(timeout_s=30).image_index for _ in range(sent)]
        assert received == list(range(sent))
        with pytest.raises(TimeoutError):
            rx.recv(timeout_s=0.5)  # and not one more (the timed-out message was never queued)
        send(tx, request_id="after", image_index=0)  # the socket still works after a Timeout
        assert rx.recv(timeout_s=10).request_id == "after"


def test_absent_receiver_times_out_and_close_is_bounded(short_dir):
    tx = LLMSender(f"ipc://{short_dir}/nobody.sock", sndhwm=2, linger_s=0.1)
    sent, timeout = send_until_timeout(tx, 10)
    assert isinstance(timeout, Timeout)
    assert sent == 2  # exactly SNDHWM messages queue while nobody is connected
    tx.close()  # returns after linger_s although 2 messages are still queued
    with pytest.raises(RuntimeError, match="closed"):
        send(tx)


def test_close_flushes_queued_messages_within_linger(receiver):
    tx = LLMSender(receiver.endpoint, linger_s=10.0)
    for i in range(5):
        send(tx, image_index=i, num_images=5)  # handed to ZMQ; maybe not yet on the wire
    tx.close()  # LINGER keeps the context alive until they are delivered
    assert [receiver.recv(timeout_s=10).image_index for _ in range(5)] == list(range(5))


def test_waiting_for_the_lock_respects_the_deadline(short_dir):
    with LLMSender(f"ipc://{short_dir}/nobody.sock", sndhwm=1, linger_s=0.1) as tx:
        send(tx, image_index=0, num_images=3)  # fills the queue: nobody reads
        blocked = threading.Thread(
            target=lambda: pytest.raises(Timeout, send, tx, image_index=1, num_images=3,
                                         deadline=time.monotonic() + 3.0)
        )  # fmt: skip
        blocked.start()
        while not tx._lock.locked():  # wait until that send holds the socket
            time.sleep(0.01)
        with pytest.raises(Timeout, match="another send held the socket"):
            send(tx, image_index=2, num_images=3, deadline=time.monotonic() + 0.1)
        blocked.join()
        assert tx.messages_sent == 1


def test_expired_deadline_sends_nothing(receiver):
    with LLMSender(receiver.endpoint) as tx:
        with pytest.raises(Timeout):
            send(tx, deadline=time.monotonic() - 1)
        assert tx.messages_sent == 0
        assert tx.bytes_sent == 0
    with pytest.raises(TimeoutError):
        receiver.recv(timeout_s=0.2)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5555", "inproc://x", "http://127.0.0.1:1"])
def test_bad_endpoint_names_the_flag(endpoint):
    with pytest.raises(ConfigError, match="--llm_endpoint"):
        LLMSender(endpoint)
