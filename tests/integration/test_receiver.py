"""LLMSender -> EmbeddingReceiver over real ZMQ sockets (tcp://127.0.0.1 and ipc://), wire v3 (docs/wire.md)."""

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

from vitserve.errors import ConfigError, LLMTimeout, NotReady
from vitserve.rpc import EmbeddingReceiver, ImageEmbedding, LLMSender, encode_embedding_message
from vitserve.rpc.delivery import Delivery


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
    message = ImageEmbedding(
        request_id=request_id,
        image_index=image_index,
        num_images=num_images,
        image_id=f"{request_id}-{image_index}",
        model="tiny",
        grid_thw=(1, 4, 4),
        embedding=embedding,
        deepstack=list(deepstack),
    )
    return sender.send(message, deadline=far() if deadline is None else deadline)


def frames_for(request_id="raw", expires_in=30.0, message_id=None):
    return encode_embedding_message(ImageEmbedding(
        request_id=request_id, image_index=0, num_images=1, image_id="x", model="m", grid_thw=(1, 2, 2),
        embedding=torch.ones(2, 4), expires_at=time.time() + expires_in, message_id=message_id or "",
    ))  # fmt: skip


def wait_reachable(tx: LLMSender, limit_s: float = 10.0) -> None:
    end = time.monotonic() + limit_s
    while not tx.reachable:
        assert time.monotonic() < end, "the sender never completed a handshake with the receiver"
        time.sleep(0.01)


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_with_deepstack_is_byte_identical(receiver, dtype):
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(100, 64, generator=g).to(dtype)
    deep = [torch.randn(100, 64, generator=g).to(dtype) for _ in range(3)]
    with LLMSender(receiver.endpoint) as tx:
        delivery = send(tx, request_id="r-7", image_index=2, num_images=5, embedding=emb, deepstack=deep)
        msg = receiver.recv(timeout_s=10)
        delivery.wait(10)  # recv() acknowledged it
        assert (tx.delivered, tx.timed_out) == (1, 0)
    nbytes = delivery.nbytes
    assert isinstance(msg, ImageEmbedding)
    assert msg.message_id == delivery.message_id
    assert 0 < msg.expires_at - time.time() < 30
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
        delivery = send(tx, image_index=0)  # waits in the sender's outbox: nobody has bound yet
        assert not tx.reachable
        with EmbeddingReceiver(endpoint) as rx:
            assert rx.recv(timeout_s=10).image_index == 0
            delivery.wait(10)


class LateHandshakeEvents(LLMSender):
    """A sender whose I/O thread reads the monitor's connection events only once its message was sent and
    acknowledged: the order a loaded machine can produce after a reconnection, where the new handshake's
    event comes in the same poll as the acknowledgement (the handshake puts the message back in the outbox
    first). It counts as connected from the start, as a sender whose earlier connection had been up."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.reachable = True  # the I/O thread sends once it sees this (the events stay unread)
        self._wake()

    def _on_monitor(self) -> None:
        if not self._unacked:
            return  # not sent yet: leave the events queued (the poll returns at once) until it is
        self._sock.poll(5000, zmq.POLLIN)  # the acknowledgement is waiting
        super()._on_monitor()


def test_an_acknowledgement_read_after_the_handshake_event_settles_the_message(receiver):
    with LateHandshakeEvents(receiver.endpoint) as tx:
        delivery = send(tx, image_index=0)
        assert receiver.recv(timeout_s=10).image_index == 0  # acknowledged once, and read once only
        delivery.wait(10)
        assert (tx.delivered, tx.late_acks, tx.resent) == (1, 0, 1)


class AcksReadLate(LLMSender):
    """A sender whose I/O thread reads no acknowledgement until `read` is set: a loaded machine, where the
    receiver may acknowledge and close its socket before the sender's thread gets to run."""

    def __init__(self, endpoint: str) -> None:
        self.read = threading.Event()
        super().__init__(endpoint)

    def _read_acks(self) -> None:
        if self.read.is_set():
            super()._read_acks()


def test_acknowledgements_that_arrived_before_the_receiver_closed_are_still_read(receiver):
    """With ZMQ_IMMEDIATE the sender's libzmq threw the dropped connection's pipe away, unread
    acknowledgements with it: delivered messages then failed at their deadline (a CI failure of
    test_receiver_cli.py)."""
    with AcksReadLate(receiver.endpoint) as tx:
        deliveries = [send(tx, image_index=k, num_images=2) for k in range(2)]
        assert [receiver.recv(timeout_s=10).image_index for _ in range(2)] == [0, 1]  # both acknowledged
        receiver.close()  # its acknowledgements have left (linger); the connection drops
        end = time.monotonic() + 10
        while tx.reachable:  # the sender saw the connection go, with the acknowledgements still unread
            assert time.monotonic() < end
            time.sleep(0.01)
        tx.read.set()
        for d in deliveries:
            d.wait(10)
        assert (tx.delivered, tx.late_acks) == (2, 0)


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
        deliveries: list[Delivery] = []
        try:
            for r in range(requests_per_thread):
                for i in range(images):
                    deliveries.append(send(tx, request_id=f"t{t}-r{r}", image_index=i, num_images=images,
                                      embedding=torch.full((3, 5), float(t * 1000 + r * 10 + i))))  # fmt: skip
            drained.wait(timeout=60)
            for d in deliveries:
                d.wait(10)  # every one acknowledged
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)
        finally:
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
    good = frames_for("good")
    header = msgpack.unpackb(good[0])
    bad_messages = [
        [secret],
        [secret, secret, secret],
        [pickle.dumps(_Exploit(str(marker)))],
        [pickle.dumps(_Exploit(str(marker))), secret],
        [pickle.dumps(_Exploit(str(marker))), *good[1:]],
        [msgpack.packb({**header, "v": 1}), *good[1:]],  # an older version
        [good[0], secret],  # size does not match dtype x shape
        [good[0], good[1], secret],  # a frame the header does not announce
        [msgpack.packb({**header, "num_tokens": 3}), *good[1:]],
    ]
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.DEALER)
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
    assert "unknown wire version 1; this receiver speaks v3" in caplog.text
    assert "SECRET" not in caplog.text, "payload bytes leaked into the log"


def test_frame_over_max_frame_bytes_is_refused_and_receiving_goes_on():
    with EmbeddingReceiver("tcp://127.0.0.1:*", max_frame_bytes=4096) as rx, LLMSender(rx.endpoint) as tx:
        # A 16 KiB frame: the receiver disconnects the peer; the sender sends it again on each new
        # connection until its deadline, then it fails and nothing of it was ever returned.
        huge = send(tx, request_id="huge", embedding=torch.zeros(64, 64), deadline=time.monotonic() + 1)
        with pytest.raises(TimeoutError):
            rx.recv(timeout_s=1.5)
        with pytest.raises(LLMTimeout):
            huge.wait(10)
        small = send(tx, request_id="small")  # ZMQ reconnects on its own
        assert rx.recv(timeout_s=10).request_id == "small"
        small.wait(10)


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


def test_a_receiver_that_does_not_read_times_the_sender_out_and_later_drops_what_expired(short_dir, caplog):
    endpoint = f"ipc://{short_dir}/hung.sock"
    big = torch.zeros(1024, 1024)  # 4 MiB a message: the kernel's socket buffers fill after a few
    with EmbeddingReceiver(endpoint, rcvhwm=1) as rx, LLMSender(endpoint, sndhwm=1) as tx:
        wait_reachable(tx)
        deadline = time.monotonic() + 1.0
        pending = [send(tx, request_id="hung", image_index=i, num_images=50, embedding=big,
                        deadline=deadline) for i in range(50)]  # fmt: skip
        for d in pending:
            with pytest.raises(LLMTimeout, match="--llm_endpoint") as info:
                d.wait(30)
            assert (info.value.status, info.value.code) == (504, "llm_timeout")
        assert tx.timed_out == 50
        assert 0 < tx.messages_sent < 50  # some reached ZMQ's queues, the rest never left the outbox
        # The application reads again: what sits in the queues has expired; none of it is returned.
        with caplog.at_level(logging.WARNING, logger="vitserve.rpc.receiver"), pytest.raises(TimeoutError):
            rx.recv(timeout_s=1.0)
        assert rx.expired == tx.messages_sent
        assert rx.received == 0
        assert "dropped an expired message" in caplog.text
        after = send(tx, request_id="after")  # the connection still works
        assert rx.recv(timeout_s=10).request_id == "after"
        after.wait(10)


def test_slow_receiver_that_acknowledges_before_the_deadline_delivers_everything(receiver):
    with LLMSender(receiver.endpoint) as tx:
        pending = [send(tx, image_index=i, num_images=5, deadline=time.monotonic() + 20) for i in range(5)]
        got = []
        for _ in range(5):
            time.sleep(0.2)  # the application is slow between reads
            got.append(receiver.recv(timeout_s=10).image_index)
        for d in pending:
            d.wait(10)
    assert got == list(range(5))
    assert (tx.delivered, tx.timed_out) == (5, 0)


def test_absent_receiver_times_out_and_a_later_receiver_never_gets_the_message(short_dir):
    endpoint = f"ipc://{short_dir}/nobody.sock"
    with LLMSender(endpoint) as tx:
        stale = send(tx, request_id="stale", deadline=time.monotonic() + 0.5)
        with pytest.raises(LLMTimeout, match="could not be sent"):
            stale.wait(10)
        assert tx.messages_sent == 0  # it never entered a ZMQ queue
        with EmbeddingReceiver(endpoint) as rx:
            fresh = send(tx, request_id="fresh")
            assert rx.recv(timeout_s=10).request_id == "fresh"  # new work at once, not the stale one
            fresh.wait(10)
            with pytest.raises(TimeoutError):
                rx.recv(timeout_s=0.3)
    with pytest.raises(NotReady, match="closed"):
        send(tx)


def test_close_fails_what_is_not_acknowledged(receiver):
    tx = LLMSender(receiver.endpoint)
    pending = [send(tx, image_index=i, num_images=3) for i in range(3)]
    tx.close()
    for d in pending:
        with pytest.raises(NotReady, match="shut down"):
            d.wait(10)


def test_a_restarted_receiver_gets_the_unacknowledged_message_again(short_dir):
    endpoint = f"ipc://{short_dir}/restart.sock"
    with LLMSender(endpoint) as tx:
        with EmbeddingReceiver(endpoint):  # takes the message into its queue, never reads it
            wait_reachable(tx)
            delivery = send(tx, request_id="again")
            end = time.monotonic() + 10
            while tx.messages_sent == 0 and time.monotonic() < end:
                time.sleep(0.01)
        with EmbeddingReceiver(endpoint) as rx:  # the same endpoint, a new process would do the same
            assert rx.recv(timeout_s=10).message_id == delivery.message_id
            delivery.wait(10)
        assert tx.resent >= 1


def test_duplicate_is_acknowledged_again_but_returned_once(receiver, caplog):
    frames = frames_for("dup", message_id="m-dup")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(receiver.endpoint)
    try:
        dealer.send_multipart(frames)
        dealer.send_multipart(frames)  # a retry of the same message
        dealer.send_multipart(frames_for("next"))
        with caplog.at_level(logging.INFO, logger="vitserve.rpc.receiver"):
            assert receiver.recv(timeout_s=10).request_id == "dup"
            assert receiver.recv(timeout_s=10).request_id == "next"
        acks = [msgpack.unpackb(dealer.recv(), raw=False)["ack"] for _ in range(3)]
    finally:
        dealer.close(linger=0)
    assert acks[:2] == ["m-dup", "m-dup"]
    assert (receiver.received, receiver.duplicates) == (2, 1)
    assert "duplicate of message m-dup" in caplog.text


def test_expired_message_is_dropped_counted_and_not_acknowledged(receiver, caplog):
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(receiver.endpoint)
    try:
        dealer.send_multipart(frames_for("old", expires_in=-0.5, message_id="m-old"))
        dealer.send_multipart(frames_for("new", message_id="m-new"))
        with caplog.at_level(logging.WARNING, logger="vitserve.rpc.receiver"):
            assert receiver.recv(timeout_s=10).request_id == "new"
        assert msgpack.unpackb(dealer.recv(), raw=False)["ack"] == "m-new"
        assert not dealer.poll(300)  # no acknowledgement for the expired one
    finally:
        dealer.close(linger=0)
    assert (receiver.received, receiver.expired) == (1, 1)
    assert "request old image 0 expired" in caplog.text


def test_a_v1_pull_receiver_is_refused_and_logged(short_dir, caplog):
    endpoint = f"ipc://{short_dir}/v1.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    try:
        with caplog.at_level(logging.ERROR, logger="vitserve.rpc.sender"), LLMSender(endpoint) as tx:
            delivery = send(tx, deadline=time.monotonic() + 1.0)
            with pytest.raises(LLMTimeout):
                delivery.wait(10)
            assert not tx.reachable
        assert not pull.poll(100)  # nothing reached the v1 socket
    finally:
        pull.close(linger=0)
        ctx.term()
    assert "not a wire-v2 EmbeddingReceiver" in caplog.text


def test_reachable_follows_the_receiver(short_dir):
    endpoint = f"ipc://{short_dir}/reach.sock"
    with LLMSender(endpoint) as tx:
        assert not tx.reachable
        with EmbeddingReceiver(endpoint):
            wait_reachable(tx)
        end = time.monotonic() + 10
        while tx.reachable:
            assert time.monotonic() < end, "the sender did not notice the receiver closing"
            time.sleep(0.01)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5555", "inproc://x", "http://127.0.0.1:1"])
def test_bad_endpoint_names_the_flag(endpoint):
    with pytest.raises(ConfigError, match="--llm_endpoint"):
        LLMSender(endpoint)
