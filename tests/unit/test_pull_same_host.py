"""A pull on one host (rpc/pull.py, connector/fetch.py, connector/producer.py, handover/same_host.py `pull_file`): the
fetch names the store's incoming area, and a producer that sees it writes the tensor there instead of sending its
bytes; the store adopts the file as a same-host push's. Real ZMQ on loopback, a real store in a temporary directory,
vitserve's own producer callback."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import torch

from tests.unit.test_pull_fetch import EXPECT, ended, message
from vitserve.connector.fetch import Expect, FetchConfig, Fetcher
from vitserve.connector.files import read_entry
from vitserve.connector.producer import Producer
from vitserve.connector.store import EmbeddingStore, Shape, as_dict
from vitserve.handover.same_host import pull_file
from vitserve.rpc.handoff import FileEmbedding, encode_file
from vitserve.rpc.pull import Area, decode_answer, decode_fetch, encode_fetch
from vitserve.rpc.wire import WireError, _pack

pytestmark = pytest.mark.unit
UUID = "a" * 64


@pytest.fixture
def store(tmp_path):
    with contextlib.closing(
        EmbeddingStore(None, 1 << 20, Shape(24, 2), directory=str(tmp_path), dtype="float32")
    ) as s:
        yield s


@contextlib.contextmanager
def pulling(store: EmbeddingStore, to_file, area: Area | None = None):
    """A producer holding `message(UUID)` (answering files through `to_file`) and a fetcher keeping into `store`,
    naming `area` (default: the store's own)."""
    held = {UUID: message(UUID)}
    producer = Producer("tcp://127.0.0.1:*", held.get, to_file=to_file)
    f = Fetcher(FetchConfig(), store.accept, area=area or store.area())
    try:
        yield producer, f, held[UUID]
    finally:
        f.close()
        producer.close()


def incoming_files(store: EmbeddingStore) -> list[Path]:
    return list(Path(store.area().incoming).iterdir())


def loaded(store: EmbeddingStore) -> torch.Tensor:
    entry = as_dict(store.get(UUID))
    assert entry is not None
    return read_entry(entry["path"], entry["dtype"], entry["rows"], entry["width"])


def test_a_producer_on_the_connectors_host_answers_with_a_file_the_store_adopts(store):
    with pulling(store, pull_file) as (producer, f, sent):
        f.start(UUID, producer.endpoint, EXPECT)
        outcome = ended(f, UUID)
    assert outcome.kept, outcome.reason
    assert producer.counts["files"] == 1
    assert store.counts["adopted"] == 1
    assert f.counters()["bytes"] == 12 * 24 * 4
    assert torch.equal(loaded(store), torch.cat([sent.embedding, *sent.deepstack], dim=1))
    assert incoming_files(store) == []  # adopted: renamed into the store's directory


@pytest.mark.parametrize("how", ["no callback", "another directory", "the write fails"])
def test_the_bytes_go_when_the_producer_cannot_write_the_file(store, tmp_path, how):
    def failing(area: Area, m):
        raise OSError(28, "No space left on device")

    other = tmp_path / "token"
    other.write_text("not the token")
    area = Area(store.area().incoming, str(other), store.area().token) if how == "another directory" else None
    to_file = {"no callback": None, "another directory": pull_file, "the write fails": failing}[how]
    with pulling(store, to_file, area) as (producer, f, sent):
        f.start(UUID, producer.endpoint, EXPECT)
        outcome = ended(f, UUID)
    assert outcome.kept, outcome.reason
    assert producer.counts["files"] == 0
    assert store.counts["adopted"] == 0
    assert torch.equal(loaded(store), torch.cat([sent.embedding, *sent.deepstack], dim=1))


@pytest.mark.parametrize("where", ["any directory", "an area of another mode"])
def test_a_fetch_cannot_make_vitserve_write_where_it_names(store, tmp_path, where):
    """A fetch comes from whoever the producer admits: it names a directory vitserve can write and a file whose
    content it knows as the token. vitserve writes only into a connector's area: here the bytes go."""
    if where == "any directory":
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        token_file = tmp_path / "known"
    else:  # the shape of an area, but not a connector's 0700 directory
        target = tmp_path / "vitserve-ec-fake" / ".incoming"
        target.mkdir(parents=True, mode=0o755)
        target.chmod(0o755)
        token_file = target.parent / ".host-token"
    token_file.write_text("ab" * 16)
    area = Area(str(target), str(token_file), "ab" * 16)
    assert pull_file(area, message(UUID)) is None
    with pulling(store, pull_file, area) as (producer, f, _):
        f.start(UUID, producer.endpoint, EXPECT)
        outcome = ended(f, UUID)
    assert outcome.kept, outcome.reason
    assert producer.counts["files"] == 0
    assert list(target.iterdir()) == []


def test_a_file_answer_the_request_does_not_expect_fails_the_fetch_and_leaves_nothing(store):
    with pulling(store, pull_file) as (producer, f, _):
        f.start(UUID, producer.endpoint, Expect(rows=12, width=24, dtype="bfloat16"))
        outcome = ended(f, UUID)
    assert not outcome.kept
    assert "announced 12 x 24 bfloat16" in outcome.reason
    assert producer.counts["files"] == 1
    assert store.get(UUID) is None
    assert incoming_files(store) == []  # the fetcher removed the file it did not keep


def test_a_file_answer_the_store_refuses_leaves_nothing(tmp_path):
    with (
        contextlib.closing(  # a bound smaller than the tensor: refused `too_large` after the file was written
            EmbeddingStore(None, 100, Shape(24, 2), directory=str(tmp_path), dtype="float32")
        ) as small,
        pulling(small, pull_file) as (producer, f, _),
    ):
        f.start(UUID, producer.endpoint, EXPECT)
        outcome = ended(f, UUID)
        assert not outcome.kept
        assert "bound" in outcome.reason
        assert incoming_files(small) == []


def test_the_fetch_query_carries_the_area_and_an_older_one_none():
    area = Area("/dev/shm/x/.incoming", "/dev/shm/x/.host-token", "ab" * 16)
    assert decode_fetch([encode_fetch(UUID, "q1", area)]).area == area
    assert decode_fetch([encode_fetch(UUID, "q1")]).area is None
    with pytest.raises(WireError, match="incoming, token_file and token"):
        decode_fetch([_pack({"v": 3, "fetch": UUID, "query_id": "q", "incoming": "/x", "token": 7})])


def test_a_file_answer_decodes_and_a_hello_in_its_place_is_not_the_wire():
    f = FileEmbedding("in-" + "0" * 32, 1152, 1, message_id="q1", request_id="r", uuid=UUID,
                      expires_at=time.time() + 60, grid_thw=(1, 6, 8), rows=12, width=24, dtype="float32")  # fmt: skip
    assert decode_answer([encode_file(f)]) == f
    with pytest.raises(WireError):
        decode_answer([_pack({"v": 3, "file": "in-" + "0" * 32, "hello": "q"})])
