"""The encoder-cache files (--llm_transport ec_storage, docs/vllm.md): uuids, the atomic write, the header
check, and the directory's lifetime (pins, TTL, the byte bound, the sweep, start-up) on a real directory,
read back with the safetensors library vLLM loads them with. The clock is a variable the test moves."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitserve.api.chat_parts import media_parts
from vitserve.config import Config
from vitserve.contract import ItemResult, PreparedImage, ProcessedImage
from vitserve.errors import ConfigError, InvalidRequest
from vitserve.families import FAMILIES
from vitserve.flags import build_config
from vitserve.handover.base import NO_MEDIA, Setup
from vitserve.handover.by_uuid import NotAConsumer, strip
from vitserve.handover.ec_files import (
    FILE_NAME,
    EcFileMissing,
    EcStorageError,
    EcStorageFull,
    check_file,
    ec_uuid,
    file_path,
    is_uuid,
    write_file,
)
from vitserve.handover.ec_pins import PINS_DIR
from vitserve.handover.ec_storage import EcStorageTransport
from vitserve.handover.ec_store import EcStore
from vitserve.handover.embeds import EmbedsLayout
from vitserve.metrics import Metrics
from vitserve.transport_specs import EcStorageSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tensor(rows: int, width: int = 8, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.arange(rows * width, dtype=torch.float32).reshape(rows, width).to(dtype)


def _store(root: Path, clock: Clock | None = None, **kw) -> tuple[EcStore, Metrics]:
    metrics = Metrics()
    kw = {"ttl_s": 60.0, "max_bytes": 1 << 30, **kw}
    store = EcStore(root, metrics=metrics, clock=clock or Clock(), sweep_every_s=0.0, **kw)
    return store, metrics


# ------------------------------------------------------------------------------------------------ uuids


def test_a_uuid_is_hex_and_changes_with_every_input():
    base = ec_uuid("fp", "image", "abc")
    assert is_uuid(base)
    assert "/" not in base
    assert ".." not in base
    assert base == ec_uuid("fp", "image", "abc")  # the same content and settings: the same file
    others = {ec_uuid("fp2", "image", "abc"), ec_uuid("fp", "video", "abc"), ec_uuid("fp", "image", "abd")}
    assert base not in others
    assert len(others) == 3
    assert ec_uuid("fp", "video", "a", "bc") != ec_uuid("fp", "video", "ab", "c")  # parts are separated


@pytest.mark.parametrize("name", ["../etc", "/abs", "ABC", "a" * 63, "g" * 64, ("a" * 64) + "/x"])
def test_a_name_that_is_no_uuid_names_no_file(tmp_path, name):
    assert not is_uuid(name)
    with pytest.raises(ValueError, match="not an encoder-cache uuid"):
        file_path(tmp_path, name)


# ------------------------------------------------------------------------------------------------ files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_file_holds_the_tensor_in_its_dtype_as_vllm_loads_it(tmp_path, dtype):
    uuid = ec_uuid("fp", "image", "x")
    tensor = _tensor(6, dtype=dtype)
    info = write_file(tmp_path, uuid, tensor, {"grid": "[1, 4, 6]"})
    loaded = load_file(str(tmp_path / uuid / FILE_NAME))["ec_cache"]
    assert loaded.dtype == dtype
    assert torch.equal(loaded, tensor)
    assert (info.rows, info.width) == (6, 8)
    assert os.listdir(tmp_path / uuid) == [FILE_NAME]  # no temporary file left
    checked = check_file(tmp_path, uuid, 6, 8)
    assert checked.metadata == {"grid": "[1, 4, 6]"}
    assert checked.size == info.size


def test_rewriting_a_file_replaces_it_and_never_changes_the_old_one_in_place(tmp_path):
    uuid = ec_uuid("fp", "image", "x")
    write_file(tmp_path, uuid, _tensor(4), {})
    path = tmp_path / uuid / FILE_NAME
    with open(path, "rb") as held:  # a reader with the old file open (vLLM memory-maps it)
        before = path.stat().st_ino
        write_file(tmp_path, uuid, _tensor(4) + 1, {})
        assert path.stat().st_ino != before  # a new inode renamed over it
        old = held.read()
    assert old != path.read_bytes()


def test_the_header_check_refuses_wrong_shapes_and_broken_files(tmp_path):
    uuid = ec_uuid("fp", "image", "x")
    with pytest.raises(EcFileMissing, match="is gone"):
        check_file(tmp_path, uuid)
    write_file(tmp_path, uuid, _tensor(4), {})
    with pytest.raises(EcFileMissing, match=r"holds \(4, 8\), not the \(5, 8\)"):
        check_file(tmp_path, uuid, 5, 8)
    with pytest.raises(EcFileMissing, match=r"not the \(4, 16\)"):
        check_file(tmp_path, uuid, 4, 16)
    path = tmp_path / uuid / FILE_NAME
    data = path.read_bytes()
    path.write_bytes(data[:-2])  # truncated: the data ends before the header says
    with pytest.raises(EcFileMissing, match="not one whole"):
        check_file(tmp_path, uuid, 4, 8)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(EcFileMissing, match="not a safetensors file"):
        check_file(tmp_path, uuid)


def test_a_write_that_fails_is_a_storage_error_and_leaves_nothing(tmp_path):
    (tmp_path / "ro").mkdir()
    uuid = ec_uuid("fp", "image", "x")
    (tmp_path / "ro" / uuid).write_text("a file where the directory goes")
    with pytest.raises(EcStorageError) as caught:
        write_file(tmp_path / "ro", uuid, _tensor(4), {})
    assert caught.value.status == 500
    assert caught.value.code == "ec_storage_error"
    assert EcStorageFull.status == 507
    assert EcStorageFull.code == "ec_storage_full"


# ------------------------------------------------------------------------------------------------ store


def _put(store: EcStore, name: str, rows: int = 4) -> str:
    if isinstance(store.clock, Clock):
        store.clock.now += 0.001  # one write after another: least recently used is well defined
    uuid = ec_uuid("fp", "image", name)
    store.pin(uuid)
    store.put(uuid, _tensor(rows), {"grid": "[1, 4, 4]"})
    store.unpin([uuid])
    return uuid


def test_a_file_is_reused_while_it_is_there(tmp_path):
    store, metrics = _store(tmp_path)
    uuid = _put(store, "a")
    assert store.lookup(uuid) is not None
    store.unpin([uuid])
    assert metrics.value("vitserve_ec_reuses_total") == 1
    assert metrics.value("vitserve_ec_writes_total") == 1
    (tmp_path / uuid / FILE_NAME).unlink()  # removed behind vitserve's back: a miss, not a reuse
    assert store.lookup(uuid) is None
    assert metrics.value("vitserve_ec_evictions_total", reason="vanished") == 1


def test_unused_files_go_after_the_ttl_but_a_pinned_one_stays(tmp_path):
    clock = Clock()
    store, metrics = _store(tmp_path, clock, ttl_s=60.0)
    a, b = _put(store, "a"), _put(store, "b")
    assert store.lookup(b) is not None  # b is in flight
    clock.now += 61
    store.maintain()
    assert store.uuids() == [b]
    assert not (tmp_path / a).exists()
    assert metrics.value("vitserve_ec_evictions_total", reason="ttl") == 1
    store.unpin([b])  # its TTL runs from now
    clock.now += 30
    store.maintain()
    assert store.uuids() == [b]
    clock.now += 31
    store.maintain()
    assert store.uuids() == []
    assert metrics.value("vitserve_ec_files") == 0


def test_the_byte_bound_evicts_the_least_recently_used_unpinned_files(tmp_path):
    store, metrics = _store(tmp_path)
    one = _put(store, "probe")
    size = store.bytes
    store.max_bytes = 3 * size
    names = [one] + [_put(store, n) for n in "abc"]  # four files of one size: the oldest goes
    assert store.uuids() == names[1:]
    assert store.lookup(names[1]) is not None  # now the most recently used, and pinned
    _put(store, "d")
    assert names[1] in store.uuids()
    assert names[2] not in store.uuids()
    assert store.bytes <= store.max_bytes
    assert metrics.value("vitserve_ec_bytes") == store.bytes
    assert metrics.value("vitserve_ec_evictions_total", reason="bytes") == 2


def test_the_sweep_removes_empty_directories_but_not_files_or_pinned_ones(tmp_path):
    store, metrics = _store(tmp_path)
    kept = _put(store, "kept")
    (tmp_path / ("e" * 64)).mkdir()  # what vLLM's lookup of a raw image leaves
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("not empty: not vitserve's to remove")
    pending = ec_uuid("fp", "image", "pending")
    store.pin(pending)
    (tmp_path / pending).mkdir()  # about to be written
    store.maintain()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept, "other", pending, PINS_DIR])
    assert metrics.value("vitserve_ec_swept_dirs_total") == 1
    store.unpin([pending])  # never written: its directory and its lock file go at the next upkeep
    store.maintain()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept, "other", PINS_DIR])
    assert os.listdir(tmp_path / PINS_DIR) == [kept]


def test_start_up_takes_over_an_earlier_runs_files_and_removes_broken_ones(tmp_path):
    clock = Clock()
    first, _ = _store(tmp_path, clock)
    good = _put(first, "good")
    broken = _put(first, "broken")
    path = tmp_path / broken / FILE_NAME
    path.write_bytes(path.read_bytes()[:-4])
    (tmp_path / good / ".vitserve-tmp123").write_bytes(b"half")  # a write cut short
    foreign = ec_uuid("fp", "image", "foreign")
    write_file(tmp_path, foreign, _tensor(4), {})  # another producer's (no vitserve metadata): left alone
    second, metrics = _store(tmp_path, clock)
    assert second.uuids() == [good]
    assert metrics.value("vitserve_ec_files") == 1
    assert not path.exists()
    assert os.listdir(tmp_path / good) == [FILE_NAME]
    assert (tmp_path / foreign / FILE_NAME).exists()
    assert second.lookup(good) is not None


def test_check_names_a_vanished_file(tmp_path):
    store, _ = _store(tmp_path)
    uuid = _put(store, "a")
    store.check([(uuid, 4, 8)])
    (tmp_path / uuid / FILE_NAME).unlink()
    with pytest.raises(EcFileMissing, match="is gone"):
        store.check([(uuid, 4, 8)])
    assert store.uuids() == []


# ------------------------------------------------------------------------------------------------ start-up


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--llm_transport", "files"], "is not one of inline, ec_storage"),
        (["--llm_transport", "ec_storage", "--ec_storage_path", "/x"], "set --llm_url"),
        (["--llm_url", "http://h:1", "--llm_transport", "ec_storage"], "needs --ec_storage_path"),
        (["--llm_url", "http://h:1", "--ec_storage_path", "/x"], "only with --llm_transport ec_storage"),
        (["--ec_ttl_s", "0"], "--ec_ttl_s must be > 0"),
        (["--ec_storage_gb", "-1"], "--ec_storage_gb must be > 0"),
    ],
)
def test_a_transport_setting_that_cannot_work_is_refused_naming_its_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        build_config(argv, {})


def test_the_transport_flags_read_the_environment_too(tmp_path):
    env = {
        "VITSERVE_LLM_URL": "http://h:1",
        "VITSERVE_LLM_TRANSPORT": "ec_storage",
        "VITSERVE_EC_STORAGE_PATH": str(tmp_path),
        "VITSERVE_EC_TTL_S": "30",
        "VITSERVE_EC_STORAGE_GB": "0.5",
    }
    config = build_config([], env)
    assert (config.llm_transport, config.ec_storage_path) == ("ec_storage", str(tmp_path))
    assert (config.ec_ttl_s, config.ec_storage_gb) == (30.0, 0.5)


def test_preflight_refuses_internvl_and_a_directory_it_cannot_write(tmp_path):
    config = Config(llm_url="http://h:1", llm_transport="ec_storage", ec_storage_path=str(tmp_path / "new"))
    EcStorageSpec.preflight(config, FAMILIES["qwen2_5_vl"])
    assert (tmp_path / "new").is_dir()  # made when missing
    assert list((tmp_path / "new").iterdir()) == []  # its probe file is gone
    with pytest.raises(ConfigError, match="cannot serve internvl"):
        EcStorageSpec.preflight(config, FAMILIES["internvl"])
    (tmp_path / "file").write_text("not a directory")
    blocked = Config(llm_url="http://h:1", llm_transport="ec_storage", ec_storage_path=str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="is not a writable directory"):
        EcStorageSpec.preflight(blocked, FAMILIES["qwen3_vl"])


# ------------------------------------------------------------------------------------------------ hand-over


async def _run(fn, *args):
    """The pool, in the caller's thread: the steps are the same, the order is deterministic."""
    return fn(*args)


def _transport(root: Path, family: str = "qwen3_vl") -> EcStorageTransport:
    layout = EmbedsLayout(family=family, merge_size=2, width=24 if family == "qwen3_vl" else 8)
    store, metrics = _store(root)
    setup = Setup(Config(), layout, metrics, _run, lambda: "fingerprint")
    return EcStorageTransport(setup, store)


def _encoded(data: bytes, grid=(1, 4, 6)) -> tuple[PreparedImage, ItemResult]:
    rows = grid[0] * grid[1] * grid[2] // 4
    item = ProcessedImage(torch.zeros(1), grid, rows, (28, 28), False)
    image = PreparedImage(item, hashlib.sha256(data).hexdigest(), (28, 28), 0.0, 0.0)
    main, *deep = (_tensor(rows) + k for k in range(3))  # bf16 rows, width 8; two DeepStack levels
    return image, ItemResult(rows, main, tuple(deep))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_an_encoded_image_becomes_its_file_and_a_metadata_only_part(tmp_path):
    ec = _transport(tmp_path)
    ticket = ec.begin()
    image, result = _encoded(b"image bytes")
    part = ticket.image_part(image, result, 0)
    uuid = part["uuid"]
    assert part == {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]}, "uuid": uuid}
    saved = load_file(str(tmp_path / uuid / FILE_NAME))["ec_cache"]
    assert saved.dtype == torch.bfloat16  # the tower's dtype, not widened
    assert torch.equal(saved, torch.cat([result.embedding, *result.deepstack], dim=1))  # DeepStack after main
    assert ticket.expected == [(uuid, 6, 24)]
    ticket.check()
    # the same bytes again: the part at once, from the file, before any decoding
    again = ec.begin()
    assert again.reuses
    assert asyncio.run(again.held([_sha(b"image bytes"), _sha(b"other bytes")])) == [True, False]
    assert (again.reused_part(0), again.reused_part(1)) == (part, None)
    assert again.pinned == [uuid]


def test_ready_strips_the_hashed_fields_checks_the_files_and_sends_a_small_body(tmp_path):
    ec = _transport(tmp_path)
    ticket = ec.begin()
    part = ticket.image_part(*_encoded(b"image bytes"), 0)
    payload = {"messages": [{"role": "user", "content": [part]}], "mm_processor_kwargs": {"x": 1}}
    body = asyncio.run(ticket.ready(payload))
    assert json.loads(body) == {"messages": [{"role": "user", "content": [part]}]}
    (tmp_path / part["uuid"] / FILE_NAME).unlink()
    with pytest.raises(EcFileMissing, match="is gone"):  # nothing goes upstream then
        asyncio.run(ticket.ready(payload))


def test_a_file_deleted_between_write_and_send_is_vitserves_error(tmp_path):
    ec = _transport(tmp_path)
    ticket = ec.begin()
    part = ticket.image_part(*_encoded(b"image bytes"), 0)
    (tmp_path / part["uuid"] / FILE_NAME).unlink()
    with pytest.raises(EcFileMissing, match="is gone") as caught:
        ticket.check()
    assert (caught.value.status, caught.value.code) == (500, "ec_file_missing")


def test_pins_hold_a_requests_files_until_it_is_released_once(tmp_path):
    ec = _transport(tmp_path)
    ec.store.max_bytes = 0  # every unpinned file goes at once
    ticket = ec.begin()
    uuid = ticket.image_part(*_encoded(b"a"), 0)["uuid"]
    assert ec.store.uuids() == [uuid]
    ticket.release()
    ticket.release()  # a stream releases twice (its end, and the response's background task)
    assert ec.store.uuids() == []


def test_a_non_consumers_refusal_is_a_502_saying_how_to_start_vllm(tmp_path):
    vllm_400 = (
        b'{"error":{"message":"The data should contain the fields: {\'image_grid_thw\', \'image_embeds\'}"}}'
    )
    ticket = _transport(tmp_path).begin()
    with pytest.raises(NotAConsumer, match="--ec-transfer-config") as caught:
        ticket.check_answer(400, vllm_400)
    assert (caught.value.status, caught.value.code) == (502, "llm_not_ec_consumer")
    ticket.check_answer(400, b'{"error":{"message":"max_tokens too large"}}')  # passed through
    ticket.check_answer(200, vllm_400)
    NO_MEDIA.check_answer(400, vllm_400)  # a request without media is not this transport's


def test_the_fields_vllm_hashes_uuids_with_are_removed():
    payload = {"messages": [], "mm_processor_kwargs": {"x": 1}, "media_io_kwargs": {"video": {}}, "top_p": 1}
    strip(payload)
    assert payload == {"messages": [], "top_p": 1}


def test_a_clients_uuid_is_refused_naming_its_part():
    part = {"type": "image_url", "image_url": {"url": "https://x/a.png"}, "uuid": "../../etc/passwd"}
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[0\]: a 'uuid' is not accepted"):
        media_parts({"messages": [{"role": "user", "content": [part]}]})


class _Admits:
    """The one engine call preparing makes: a queue with room (Engine.admit)."""

    def admit(self, tokens):
        return None


async def test_an_image_missed_by_ec_storage_has_its_sha256_computed_once(tmp_path, monkeypatch):
    from PIL import Image

    from vitserve.api.inputs import ImageSource
    from vitserve.api.media import Media, MediaPipeline
    from vitserve.api.preprocess import Preprocessor
    from vitserve.processors import load_image_processor

    buf = io.BytesIO()
    Image.linear_gradient("L").resize((64, 64)).convert("RGB").save(buf, "PNG")
    data = buf.getvalue()
    hashed: list[bytes] = []
    real_sha256 = hashlib.sha256

    def counting(payload=b"", *args, **kw):
        hashed.append(bytes(payload))
        return real_sha256(payload, *args, **kw)

    processor = load_image_processor("qwen2_5_vl", budget_tokens=64)
    pre = Preprocessor(processor, max_image_pixels=0, metrics=Metrics(), workers=1)
    media = MediaPipeline(Config(), _Admits(), pre, Metrics())  # type: ignore[arg-type]
    ticket = _transport(tmp_path).begin()
    monkeypatch.setattr(hashlib, "sha256", counting)
    try:
        work = await media.prepare(
            Media("r", [ImageSource(data=data)], held=ticket.held), time.monotonic() + 60
        )
    finally:
        pre.close()
    assert ticket.reused_part(0) is None  # a miss: looked up by its digest, then decoded and prepared
    assert [p.image_id for p in work.images] == [real_sha256(data).hexdigest()]
    assert hashed.count(data) == 1
