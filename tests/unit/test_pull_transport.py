"""--llm_transport pull, vitserve's side (handover/pull.py, handover/pull_store.py, docs/vllm.md "Pull"): its
flags and refusals, the store's bound and pins, and a request's item fetched for real by the connector's
Fetcher (vitserve/connector/fetch.py) from the transport's own producer over ZMQ. The connector inside a real
vLLM is tests/vllm/test_pull.py's subject."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

import pytest
import torch

from vitserve.config import Config
from vitserve.connector.fetch import Expect, FetchConfig, Fetcher
from vitserve.contract import ItemResult, PreparedImage, ProcessedImage
from vitserve.errors import ConfigError
from vitserve.flags import build_config
from vitserve.handover.base import Setup
from vitserve.handover.ec_files import ec_uuid
from vitserve.handover.embeds import EmbedsLayout
from vitserve.handover.pull import PullTransport
from vitserve.handover.pull_store import PullStore, PullStoreFull
from vitserve.handover.wire import ItemUnavailable
from vitserve.metrics import Metrics
from vitserve.rpc.wire import ImageEmbedding

pytestmark = pytest.mark.unit
PULL = ["--llm_url", "http://h:1", "--llm_transport", "pull"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--llm_transport", "pull", "--pull_bind", "tcp://127.0.0.1:5700"], "set --llm_url"),
        (PULL, "needs --pull_bind tcp://HOST:PORT"),
        ([*PULL, "--pull_bind", "ipc:///tmp/x"], "needs --pull_bind tcp://HOST:PORT"),
        ([*PULL, "--pull_bind", "tcp://0.0.0.0:5700", "--wire_key_file", "/k"], "set --pull_advertise"),
        ([*PULL, "--pull_bind", "tcp://*:5700", "--wire_key_file", "/k"], "set --pull_advertise"),
        (
            [*PULL, "--pull_bind", "tcp://0.0.0.0:5700", "--pull_advertise", "tcp://0.0.0.0:5700",
             "--wire_key_file", "/k"],
            "with a host vLLM can reach",
        ),
        ([*PULL, "--pull_bind", "tcp://10.0.0.7:5700"], "needs --wire_key_file there"),
        (
            [*PULL, "--pull_bind", "tcp://0.0.0.0:5700", "--pull_advertise", "tcp://replica-0:5700"],
            "needs --wire_key_file there",
        ),
        (["--llm_url", "http://h:1", "--pull_bind", "tcp://127.0.0.1:1"], "--pull_bind is used only with"),
        (["--llm_url", "http://h:1", "--wire_key_file", "/k"], "only with --llm_transport wire or pull"),
        ([*PULL, "--pull_bind", "tcp://127.0.0.1:1", "--pull_store_gb", "0"], "pull_store_gb"),
    ],
)  # fmt: skip
def test_a_pull_setting_that_cannot_work_is_refused_naming_its_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        build_config(argv, {})


def test_a_pull_setting_that_works_parses():
    config = build_config([*PULL, "--pull_bind", "tcp://127.0.0.1:5700"], {})
    assert (config.llm_transport, config.pull_bind, config.pull_advertise) == (
        "pull",
        "tcp://127.0.0.1:5700",
        None,
    )
    keyed = [
        *PULL,
        "--pull_bind",
        "tcp://0.0.0.0:5700",
        "--pull_advertise",
        "tcp://r0:5700",
        "--wire_key_file",
        "k",
    ]
    assert build_config(keyed, {}).pull_advertise == "tcp://r0:5700"


def test_internvl_is_refused_as_for_wire():
    from vitserve.families import FAMILIES
    from vitserve.transport_specs import PullSpec

    config = Config(llm_url="http://h:1", llm_transport="pull", pull_bind="tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="cannot serve internvl"):
        PullSpec.preflight(config, FAMILIES["internvl"])


# ------------------------------------------------------------------------------------------ the store


def _message(uuid: str, rows: int = 4, width: int = 8) -> ImageEmbedding:
    return ImageEmbedding(
        request_id="r", image_index=0, num_images=1, image_id=uuid, grid_thw=(1, 4, rows),
        embedding=torch.zeros(rows, width, dtype=torch.bfloat16), deepstack=[], model="m", uuid=uuid,
    )  # fmt: skip


def test_the_store_refuses_past_its_bound_while_requests_pin_what_it_holds():
    item = 4 * 8 * 2  # bytes of one message
    store = PullStore(max_bytes=2 * item)
    store.keep(_message("a"), "req-1")
    store.keep(_message("b"), "req-2")
    with pytest.raises(PullStoreFull, match=r"--pull_store_gb") as caught:
        store.keep(_message("c"), "req-3")
    assert caught.value.status == 503
    assert store.find("c") is None
    assert store.counts["refused_full"] == 1
    store.release(["a"], "req-1")  # answered: kept for a retry, but the first to go for room
    assert store.find("a") is not None
    store.keep(_message("c"), "req-3")
    assert store.find("a") is None
    assert store.find("c") is not None
    assert store.counts["evicted"] == 1
    assert store.held_bytes == 2 * item


def test_the_same_item_kept_by_two_requests_stays_until_both_are_answered():
    store = PullStore(max_bytes=64)
    store.keep(_message("a"), "req-1")
    store.keep(_message("a"), "req-2")
    assert len(store) == 1
    store.release(["a"], "req-1")
    with pytest.raises(PullStoreFull):
        store.keep(_message("b"), "req-3")  # "a" is still pinned by req-2
    store.release(["a"], "req-2")
    store.keep(_message("b"), "req-3")
    assert store.find("a") is None


def test_a_released_item_expires_after_keep_s():
    store = PullStore(max_bytes=1 << 20, keep_s=0.05)
    store.keep(_message("a"), "req-1")
    store.release(["a"], "req-1")
    deadline = time.monotonic() + 10
    while store.find("a") is not None and time.monotonic() < deadline:
        time.sleep(0.06)
        store.release([], "nobody")  # any call sweeps
    assert store.find("a") is None
    assert store.counts["expired"] == 1


# --------------------------------------------------------------------------------------- the hand-over


async def _inline(fn, *args):
    return fn(*args)


def _transport(store_gb: float = 1.0) -> PullTransport:
    layout = EmbedsLayout(family="qwen2_5_vl", merge_size=2, width=8)
    config = Config(
        llm_url="http://h:1", llm_transport="pull", pull_bind="tcp://127.0.0.1:0", pull_store_gb=store_gb
    )
    return PullTransport(Setup(config, layout, Metrics(), _inline, lambda: "fingerprint"))


def _encoded(data: bytes, grid=(1, 4, 6)) -> tuple[PreparedImage, ItemResult]:
    rows = grid[0] * grid[1] * grid[2] // 4
    item = ProcessedImage(torch.zeros(1), grid, rows, (28, 28), False)
    image = PreparedImage(item, hashlib.sha256(data).hexdigest(), (28, 28), 0.0, 0.0)
    return image, ItemResult(rows, torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8), ())


def test_a_request_announces_its_producer_and_the_connectors_fetcher_gets_the_item():
    pull = _transport()
    fetched: list[ImageEmbedding] = []
    fetcher = Fetcher(FetchConfig(), on_message=lambda m: fetched.append(m))
    try:
        request = pull.begin()
        image, result = _encoded(b"image bytes")
        part = request.image_part(image, result, 0)
        uuid = ec_uuid("fingerprint", "image", image.image_id)
        assert part == {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]}, "uuid": uuid}
        payload = {"messages": [], "mm_processor_kwargs": {"x": 1}}
        body = json.loads(asyncio.run(request.ready(payload)))
        assert "mm_processor_kwargs" not in body
        (item,) = body["ec_transfer_params"]["vitserve"]["items"].values()
        assert item == {"rows": 6, "width": 8, "dtype": "float32", "producer": pull.advertise}
        assert pull.advertise.startswith("tcp://127.0.0.1:")
        assert not pull.advertise.endswith(":0")
        assert fetcher.start(uuid, item["producer"], Expect(6, 8, "float32")) is None
        deadline = time.monotonic() + 10
        while fetcher.result(uuid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        outcome = fetcher.result(uuid)
        assert outcome is not None
        assert outcome.kept, outcome.reason
        assert torch.equal(fetched[0].embedding, result.embedding)
        # the same image again while kept: no encoding, the same part, pinned by the new request too
        again = pull.begin()
        assert asyncio.run(again.held([image.image_id])) == [True]
        assert again.reused_part(0) == part
        request.release()
        again.release()
        assert pull.store.find(uuid) is not None  # kept for a retry until keep_s
    finally:
        fetcher.close()
        asyncio.run(pull.close())


def test_a_full_store_refuses_before_anything_goes_upstream_and_releases_what_it_kept():
    pull = _transport(store_gb=300 / 2**30)  # room for one 6 x 8 float32 item (192 bytes), not two
    try:
        first = pull.begin()
        first.image_part(*_encoded(b"one"), 0)
        asyncio.run(first.ready({}))
        second = pull.begin()
        second.image_part(*_encoded(b"two"), 0)
        with pytest.raises(PullStoreFull, match="nothing was sent to vLLM"):
            asyncio.run(second.ready({}))
        first.release()
        asyncio.run(second.ready({}))  # room now: the first is released, and evicted for it
    finally:
        asyncio.run(pull.close())


def test_vllms_500_is_a_502_naming_the_producer():
    pull = _transport()
    try:
        with pytest.raises(ItemUnavailable, match="could not fetch an item") as caught:
            pull.begin().check_answer(500, b'{"error": {"message": "Internal server error"}}')
        assert caught.value.status == 502
        assert pull.advertise in caught.value.message
    finally:
        asyncio.run(pull.close())


# --------------------------------------------------------------------------- the connector's side (no vLLM)


def _wait(fn, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while (value := fn()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def test_the_connector_fetches_an_announced_item_into_its_store_and_fails_what_it_cannot_get(tmp_path):
    from vitserve.connector.admission import Announced
    from vitserve.connector.config import parse_config, start_store
    from vitserve.connector.pulling import Puller
    from vitserve.connector.store import Shape

    log = logging.getLogger("test")
    config, _ = parse_config({"shm_dir": str(tmp_path), "wait_s": 5})
    store = start_store(config, Shape(8, 2), log)
    puller = Puller(config, None, store, log)
    pull = _transport()
    try:
        request = pull.begin()
        image, result = _encoded(b"image bytes")
        request.image_part(image, result, 0)
        body = json.loads(asyncio.run(request.ready({})))
        announced = {
            uuid: Announced(a["rows"], a["width"], a["dtype"], a["producer"])
            for uuid, a in body["ec_transfer_params"]["vitserve"]["items"].items()
        }
        (uuid,) = announced
        assert puller.step("vllm-1", (uuid,), announced, 5.0) is None  # started: the request waits
        assert puller.wait((uuid,), 5.0) is True  # an idle engine's wait in place: until it is kept
        held = store.get(uuid)
        assert held is not None
        assert (held.rows, held.width, held.dtype) == (6, 8, "float32")
        assert store.counters()["received"] == 1
        # a producer that does not hold it: that request fails, naming the producer and why
        gone = {"f" * 64: Announced(6, 8, "float32", pull.advertise)}
        assert puller.step("vllm-2", tuple(gone), gone, 5.0) is None
        why = _wait(lambda: puller.step("vllm-2", tuple(gone), gone, 5.0))
        assert why is not None
        assert pull.advertise in why
        assert "not held" in why
        # a producer outside pull_from: refused at once, no network
        far = {"e" * 64: Announced(6, 8, "float32", "tcp://10.9.9.9:5700")}
        refused = puller.step("vllm-3", tuple(far), far, 5.0)
        assert refused is not None
        assert "10.9.9.9" in refused
    finally:
        puller.close()
        store.close()
        asyncio.run(pull.close())


def test_the_documented_pull_commands_agree(tmp_path):
    """docs/vllm.md "Pull": vitserve takes its flags (the key file stood in for), and the connector's pull_from
    admits the producer vitserve advertises, with the same key file."""
    from tests.vllm import wire_docs
    from vitserve.connector.allowlist import Allowlist

    vitserve, vllm = (
        argv for b in wire_docs.section("## Pull (`--llm_transport pull`)") for argv in wire_docs.commands(b)
    )
    assert vllm[:3] == wire_docs.VLLM_MODULE
    extra = wire_docs.ec_transfer_config(wire_docs.options(vllm[3:])["ec-transfer-config"])
    extra = extra["ec_connector_extra_config"]
    assert "endpoint" not in extra
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    assert vitserve[0] == "vitserve"
    config = build_config([str(key) if a == extra["key_file"] else a for a in vitserve[1:]], {})
    assert config.llm_transport == "pull"
    assert config.wire_key_file == str(key)
    assert Allowlist(tuple(extra["pull_from"])).refuses(config.pull_advertise or "") is None


def test_an_idle_engine_waits_in_place_once_per_step_and_never_beside_other_work():
    """pulling.py `EngineSteps`, as the glue feeds it from vLLM's scheduler: a request may wait in place for its
    fetches only when no other request runs (scheduled in an earlier step, not finished) and nothing was admitted
    or waited for in this step."""
    from vitserve.connector.pulling import EngineSteps

    steps = EngineSteps()
    assert steps.idle_but("a"), "a fresh engine runs nothing"
    steps.has_work()  # "a" waited (or another request was admitted) in this step
    assert not steps.idle_but("b"), "one wait in place per step"
    steps.stepped(["a"], [])
    assert steps.idle_but("a"), "its own later chunks: nothing else runs"
    assert not steps.idle_but("b"), "a runs: b defers, its fetch beside a's step"
    steps.finished("a")
    assert steps.idle_but("b")
    steps.stepped(["c", "d"], [])
    steps.stepped([], ["c"])  # a finish vLLM reports in the next step's output
    assert not steps.idle_but("b")
    steps.finished("d")
    assert steps.idle_but("b")
