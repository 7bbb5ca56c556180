"""The same-host hand-over (vitserve/connector/handoff.py, vitserve/handover/same_host.py, rpc/handoff.py): real ZMQ on
loopback, a real LLMSender, real files, a real small tmpfs for a full device. vitserve learns the connector's
incoming area and dtype from a hello, writes the tensor there once and sends its name; the connector adopts it
checked, and refuses (nack "bad_file", nothing left behind) every file that is not what its message says."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from tests.unit.test_connector_hostile import tmpfs  # noqa: F401  # the 1 MiB tmpfs fixture
from tests.unit.test_connector_store import REPLY_MS, WIDTH
from vitserve.connector.store import EmbeddingStore, Shape, as_dict, read_entry
from vitserve.handover.same_host import SameHost, probe, shares_directory, write_file
from vitserve.rpc.delivery import WireRefused
from vitserve.rpc.handoff import (
    LEGACY_SAMPLE_BYTES,
    SAMPLE_BYTES,
    FileEmbedding,
    decode_handoff,
    decode_info,
    encode_file,
    encode_info,
    sampled_crc,
)
from vitserve.rpc.replies import Ack, Nack, decode_reply
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.wire import ImageEmbedding, WireError


@pytest.fixture
def store(tmp_path):
    with contextlib.closing(
        EmbeddingStore(
            "tcp://127.0.0.1:*", 1 << 20, Shape(WIDTH, 2), directory=str(tmp_path), dtype="bfloat16"
        )
    ) as s:
        yield s


def message(uuid: str, rows: int = 12) -> ImageEmbedding:
    g = torch.Generator().manual_seed(rows)
    parts = [torch.randn(rows, 8, generator=g) for _ in range(3)]  # float32, as a CPU tower makes them
    return ImageEmbedding(request_id="r", image_index=0, num_images=1, image_id="0" * 64,
                          grid_thw=(1, 2, 2 * rows), embedding=parts[0], deepstack=parts[1:], uuid=uuid)  # fmt: skip


def incoming(store: EmbeddingStore) -> Path:
    return store.dir / ".incoming"


def send_file(store: EmbeddingStore, f: FileEmbedding):
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.linger = 0
        sock.connect(store.endpoint)
        sock.send(encode_file(f))
        return decode_reply(sock.recv()) if sock.poll(REPLY_MS) else None


def written(store: EmbeddingStore, uuid: str = "a" * 64) -> FileEmbedding:
    """A file vitserve wrote into the incoming area, and its message."""
    return write_file(incoming(store), message(uuid), torch.bfloat16, time.time() + 60)


def test_the_hello_says_where_and_what_and_vitserve_sees_the_same_directory(store):
    info = probe(store.endpoint, None)
    assert info is not None
    assert (info.incoming, info.dtype, info.width) == (str(incoming(store)), "bfloat16", WIDTH)
    assert shares_directory(info)
    assert not shares_directory(
        info.__class__(**{**info.__dict__, "token": "f" * 32})
    )  # another host's token


def test_one_write_the_connector_adopts_it_whole_in_vllms_dtype_and_nothing_is_left(store):
    with LLMSender(store.endpoint) as sender:
        assert sender.wait_reachable(30)
        same = SameHost(sender)
        assert same.dtype(torch.float32) == torch.bfloat16
        assert same.local
        m = message("a" * 64)
        same.send(m, time.monotonic() + 30, torch.bfloat16).wait(30)
    assert same.files == 1
    entry = store.get("a" * 64)
    assert (entry.rows, entry.width, entry.dtype) == (12, WIDTH, "bfloat16")
    w = as_dict(entry)
    expected = torch.cat([m.embedding, *m.deepstack], dim=-1).to(torch.bfloat16)
    assert torch.equal(read_entry(w["path"], w["dtype"], w["rows"], w["width"]), expected)
    assert list(incoming(store).iterdir()) == []
    assert store.counters()["received"] == 1


def test_across_hosts_the_bytes_travel_already_cast(store):
    with LLMSender(store.endpoint) as sender:
        assert sender.wait_reachable(30)
        same = SameHost(sender)
        assert same.dtype(torch.float32) == torch.bfloat16
        same.local = False  # what a vitserve of another host finds: the token is not readable there
        same.send(message("b" * 64), time.monotonic() + 30, torch.bfloat16).wait(30)
    assert same.files == 0
    assert store.get("b" * 64).dtype == "bfloat16"


def _hostile(store: EmbeddingStore, tmp_path: Path) -> dict[str, FileEmbedding]:
    """Each kind of file that is not what its message says, written into the incoming area."""
    area, outside = incoming(store), tmp_path / "outside"
    outside.write_bytes(b"\1" * 12 * WIDTH * 2)
    cases = {}
    f = written(store, "1" * 64)
    (area / f.name).unlink()  # its message names another path
    cases["escaping name"] = FileEmbedding(**{**f.__dict__, "name": "../../outside"})
    link = written(store, "2" * 64)
    (area / link.name).unlink()
    (area / link.name).symlink_to(outside)
    cases["symlink"] = link
    short = written(store, "3" * 64)
    os.truncate(area / short.name, short.nbytes - 2)
    cases["short file"] = short
    crc = written(store, "4" * 64)
    cases["wrong checksum"] = FileEmbedding(**{**crc.__dict__, "crc": crc.crc ^ 1})
    fifo = written(store, "5" * 64)
    (area / fifo.name).unlink()
    os.mkfifo(area / fifo.name)
    cases["fifo"] = fifo
    hard = written(store, "6" * 64)
    os.link(area / hard.name, tmp_path / "hard")
    cases["hard link"] = hard
    missing = written(store, "7" * 64)
    (area / missing.name).unlink()
    cases["missing"] = missing
    rows = written(store, "8" * 64)
    cases["size against rows"] = FileEmbedding(**{**rows.__dict__, "rows": 8, "grid_thw": (1, 2, 16)})
    if os.getuid() == 0:
        other = written(store, "9" * 64)
        os.chown(area / other.name, 65534, 65534)
        cases["another uid's file"] = other
    return cases


def test_every_hostile_file_is_a_bad_file_nack_nothing_is_left_and_the_receiver_answers(store, tmp_path):
    for case, f in _hostile(store, tmp_path).items():
        reply = send_file(store, f)
        assert isinstance(reply, Nack), case
        assert reply.reason.startswith("bad_file: "), (case, reply.reason)
        assert store.get(f.uuid) is None, case
    assert (tmp_path / "outside").read_bytes() == b"\1" * 12 * WIDTH * 2  # untouched by the escaping name
    assert list(incoming(store).iterdir()) == []
    assert (tmp_path / "hard").exists()  # the other name of a hard link is not the connector's to remove
    assert store.counters()["held"] == 0
    assert isinstance(send_file(store, written(store)), Ack)  # and the next good one is kept


def test_a_checksum_reads_a_sample_not_every_byte(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(5 << 20))
    fd = os.open(path, os.O_RDWR)
    try:
        before = sampled_crc(fd, 5 << 20)
        os.pwrite(fd, b"\0", (5 << 20) - 1)  # the last byte: always sampled
        assert sampled_crc(fd, 5 << 20) != before
    finally:
        os.close(fd)


def test_the_checksums_sample_is_agreed_with_an_older_end_either_way(store):
    """The connector's info names the 4 KiB sample and checks a message with the sample it names; an older
    vitserve's message names none (64 KiB) and is adopted; an older connector's info names none, and vitserve
    then sums 64 KiB; a sample of another size is malformed."""
    info = probe(store.endpoint, None)
    assert info is not None
    assert info.sample == SAMPLE_BYTES
    old = written(store, "b" * 64)  # an older vitserve: its checksum over 64 KiB windows, no `sample` field
    fd = os.open(incoming(store) / old.name, os.O_RDONLY)
    try:
        crc = sampled_crc(fd, old.nbytes, LEGACY_SAMPLE_BYTES)
    finally:
        os.close(fd)
    header = msgpack.unpackb(encode_file(dataclasses.replace(old, crc=crc)))
    del header["sample"]
    assert decode_handoff([msgpack.packb(header)]).sample == LEGACY_SAMPLE_BYTES  # type: ignore[union-attr]
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.linger = 0
        sock.connect(store.endpoint)
        sock.send(msgpack.packb(header))
        assert sock.poll(REPLY_MS)
        assert isinstance(decode_reply(sock.recv()), Ack)
    older_info = msgpack.unpackb(encode_info(info))
    del older_info["sample"]
    assert decode_info(msgpack.packb(older_info)).sample == LEGACY_SAMPLE_BYTES
    with pytest.raises(WireError, match="sample must be one of"):
        decode_handoff([msgpack.packb({**header, "sample": 1})])


def test_a_full_device_the_write_fails_cleanly_and_the_bytes_are_refused_device_full(tmpfs):  # noqa: F811
    with contextlib.closing(
        EmbeddingStore("tcp://127.0.0.1:*", 10 << 20, Shape(WIDTH, 2), directory=str(tmpfs), dtype="float32")
    ) as s, LLMSender(s.endpoint) as sender:  # fmt: skip
        assert sender.wait_reachable(30)
        same = SameHost(sender)
        assert same.dtype(torch.float32) == torch.float32
        assert same.local
        (tmpfs / "filler").write_bytes(b"\0" * (700 << 10))
        big = message("c" * 64, rows=4096)  # 384 KiB: does not fit in what is left
        with pytest.raises(WireRefused, match="device_full"):
            same.send(big, time.monotonic() + 30, torch.float32).wait(30)
        assert same.files == 0
        assert list((s.dir / ".incoming").iterdir()) == []
        assert [p for p in s.dir.iterdir() if not p.name.startswith(".")] == []
        (tmpfs / "filler").unlink()
        same.send(big, time.monotonic() + 30, torch.float32).wait(30)  # room again: one write
        assert same.files == 1
        assert s.get("c" * 64) is not None


def test_a_file_nobody_announced_is_removed_after_a_while(store):
    f = written(store)
    old = time.time() - 120  # its writer died two minutes ago
    os.utime(incoming(store) / f.name, (old, old))
    fresh = written(store, "b" * 64)
    store._incoming._swept -= 60  # the receiver's next sweep is due
    store._incoming.sweep()
    assert [p.name for p in incoming(store).iterdir()] == [fresh.name]


def test_a_restarted_connector_is_asked_again_and_its_new_area_is_used(tmp_path):
    first = EmbeddingStore(
        "tcp://127.0.0.1:*", 1 << 20, Shape(WIDTH, 2), directory=str(tmp_path), dtype="float32"
    )
    endpoint = first.endpoint
    with LLMSender(endpoint) as sender:
        assert sender.wait_reachable(30)
        same = SameHost(sender)
        same.send(message("a" * 64), time.monotonic() + 30, torch.float32).wait(30)
        first.close()  # vLLM restarted: its directory and token are gone
        with contextlib.closing(
            EmbeddingStore(endpoint, 1 << 20, Shape(WIDTH, 2), directory=str(tmp_path), dtype="float32")
        ) as second:
            assert sender.wait_reachable(30)
            same.send(message("b" * 64), time.monotonic() + 30, torch.float32).wait(30)
            assert same.files == 2
            assert second.counters()["adopted"] == 1
            assert same.info.incoming == str(second.dir / ".incoming")
