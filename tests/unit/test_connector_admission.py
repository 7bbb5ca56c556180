"""The connector's pure decisions (vitserve/connector/admission.py, counters.py, config.py) without vLLM: which
items of a request it supplies, defers or fails on; how an announcement is checked; how its counters become
vLLM's stats; how its extra config is read and protected mode refuses. The same code runs inside vLLM
(tests/vllm/test_connector.py drives it through a real one)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from vitserve.connector import counters
from vitserve.connector.admission import (
    MAX_ITEMS,
    Announced,
    AnnouncementError,
    Item,
    admit,
    keep_waiting,
    parse_announcement,
)
from vitserve.connector.config import ConnectorConfig, for_rank, parse_config, start_store
from vitserve.connector.store import Shape
from vitserve.rpc.tensors import DTYPES

WIDTH = 192
U, V = "a" * 64, "b" * 64


@dataclass
class Held:
    rows: int
    width: int
    dtype: str


def announce(**items: dict) -> dict:
    return {"vitserve": {"v": 1, "items": items}, "other_connector": {"x": 1}}


def item(rows: int = 12, width: int = WIDTH, dtype: str = "float32") -> dict:
    return {"rows": rows, "width": width, "dtype": dtype, "later": "ignored: a later version's key"}


def test_an_announcement_is_read_and_unknown_keys_are_ignored():
    got = parse_announcement(announce(**{U: item()}), DTYPES)
    assert got == {U: Announced(12, WIDTH, "float32")}
    assert parse_announcement(None, DTYPES) == {}
    assert parse_announcement({"someone_else": 1}, DTYPES) == {}


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ([1, 2], "must be an object"),
        ({"vitserve": "x"}, "must be an object"),
        ({"vitserve": {"v": 2, "items": {}}}, "reads 1"),
        ({"vitserve": {"v": True, "items": {}}}, "reads 1"),
        ({"vitserve": {"v": 1, "items": []}}, "uuid -> item"),
        (announce(**{U: "12x192"}), "rows, width and dtype"),
        (announce(**{U: item(rows=0)}), "rows must be a positive integer"),
        (announce(**{U: item(rows=True)}), "rows must be a positive integer"),
        (announce(**{U: item(width=1.5)}), "width must be a positive integer"),
        (announce(**{U: item(dtype="float8")}), "dtype 'float8' is not one of"),
        ({"vitserve": {"v": 1, "items": {"": item()}}}, "uuid must be a string"),
        ({"vitserve": {"v": 1, "items": {str(i): item() for i in range(MAX_ITEMS + 1)}}}, "at most"),
    ],
)
def test_a_malformed_announcement_is_an_error_naming_what_is_wrong(params, says):
    with pytest.raises(AnnouncementError, match=says):
        parse_announcement(params, DTYPES)


def held_of(**tensors: Held):
    return lambda uuid: tensors.get(uuid)


def test_an_announced_item_held_as_announced_is_supplied():
    verdict = admit(
        [Item(U, 12, has_content=False)],
        {U: Announced(12, WIDTH, "float32")},
        held_of(**{U: Held(12, WIDTH, "float32")}),
        WIDTH,
    )
    assert (verdict.supply, verdict.missing, verdict.failure) == ({U}, (), None)


def test_an_item_without_pixels_that_is_not_announced_fails_the_request_even_when_held():
    verdict = admit([Item(U, 12, has_content=False)], {}, held_of(**{U: Held(12, WIDTH, "float32")}), WIDTH)
    assert verdict.supply == frozenset()
    assert verdict.reason == "unannounced"
    assert "does not announce it" in verdict.failure


def test_an_item_with_pixels_is_vllms_own_unless_announced_and_held_as_announced():
    pixels = Item(U, 12, has_content=True)
    held = held_of(**{U: Held(12, WIDTH, "float32")})
    assert admit([pixels], {}, held, WIDTH) == admit([], {}, held, WIDTH)  # a client's own uuid: never ours
    wrong = {U: Announced(12, WIDTH, "bfloat16")}
    assert admit([pixels], wrong, held, WIDTH).supply == frozenset()  # mismatch: vLLM encodes it
    assert admit([pixels], {U: Announced(12, WIDTH, "float32")}, held, WIDTH).supply == {U}
    assert admit([pixels], {U: Announced(12, WIDTH, "float32")}, held_of(), WIDTH).missing == ()


@pytest.mark.parametrize(
    ("placeholder", "announced", "held", "says"),
    [
        (8, Announced(12, WIDTH, "float32"), Held(12, WIDTH, "float32"), "placeholder needs 8"),
        (12, Announced(12, 64, "float32"), Held(12, 64, "float32"), "this model needs 192"),
        (12, Announced(12, WIDTH, "float32"), Held(12, WIDTH, "bfloat16"), "holds 12 x 192 bfloat16"),
        (12, Announced(12, WIDTH, "float32"), Held(10, WIDTH, "float32"), "holds 10 x 192"),
    ],
)
def test_a_tensor_that_disagrees_with_announcement_placeholder_or_model_fails_the_request(
    placeholder, announced, held, says
):
    verdict = admit([Item(U, placeholder, has_content=False)], {U: announced}, held_of(**{U: held}), WIDTH)
    assert verdict.reason == "mismatch"
    assert says in verdict.failure
    assert verdict.supply == frozenset()


def test_an_announced_item_not_here_yet_is_missing_and_done_items_are_skipped():
    announced = {U: Announced(12, WIDTH, "float32"), V: Announced(4, WIDTH, "float32")}
    items = [Item(U, 0, has_content=False, done=True), Item(V, 4, has_content=False)]
    verdict = admit(items, announced, held_of(), WIDTH)
    assert (verdict.supply, verdict.missing, verdict.failure) == (frozenset(), (V,), None)
    assert admit(items[:1], {}, held_of(), WIDTH).failure is None  # in the KV cache: nothing to check


def test_waiting_ends_at_wait_s_or_at_once_when_the_receiver_failed():
    assert keep_waiting([U], 0.5, 1.0, None) is None
    assert "never arrived (waited 1 s" in keep_waiting([U], 1.0, 1.0, None)
    assert "receiver failed meanwhile: restarted" in keep_waiting([U], 0.0, 1.0, "restarted")


def test_counters_become_deltas_with_reasons_and_merge():
    before = {"received": 2, "refused": 1, "refused_rows": 1, "held_bytes": 10, "held": 1}
    now = {
        "received": 5,
        "refused": 4,
        "refused_rows": 2,
        "held_bytes": 30,
        "held": 3,
        "failed_unannounced": 1,
    }
    data = counters.delta(before, now)
    assert data == {
        "counts": {"received": 3, "refused_rows": 1, "refused_other": 2, "failed_unannounced": 1},
        "gauges": {"held_bytes": 30, "held": 3},
    }
    assert counters.delta(now, dict(now)) == {}
    later = counters.delta(now, {**now, "received": 6, "held_bytes": 40})
    assert counters.merge(data, later)["counts"]["received"] == 4
    assert counters.merge(data, later)["gauges"]["held_bytes"] == 40
    assert counters.metric("refused_rows") == ("refused", "rows")
    assert counters.metric("failed_mismatch") == ("requests_failed", "mismatch")
    assert counters.metric("received") == ("received", None)


def test_the_extra_config_is_read_and_a_wrong_value_names_its_key():
    config, unknown = parse_config({"endpoint": "tcp://127.0.0.1:1", "max_gb": 1, "wait_s": 2, "max_bgb": 3})
    assert config == ConnectorConfig("tcp://127.0.0.1:1", max_gb=1.0, wait_s=2.0)
    assert unknown == ["max_bgb"]
    for extra, says in [
        ({"endpoint": ""}, "endpoint must be the ZMQ address"),
        ({"pull_from": "10.0.0.0/8"}, "pull_from must be a list"),
        ({"pull_from": ["*"]}, "pull_from: "),
        ({"endpoint": "tcp://127.0.0.1:1", "max_gb": "4"}, "max_gb must be a number > 0, not '4'"),
        ({"endpoint": "tcp://127.0.0.1:1", "max_hold_s": 0}, "max_hold_s must be a number > 0"),
        ({"endpoint": "tcp://127.0.0.1:1", "allow_unauthenticated": "true"}, "must be true or false"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_config(extra)


def test_a_keyless_connector_refuses_an_endpoint_another_host_could_reach(tmp_path):
    log = logging.getLogger("test")
    config, _ = parse_config({"endpoint": "tcp://0.0.0.0:0", "shm_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="allow_unauthenticated"):
        start_store(config, Shape(WIDTH, 2), log).close()
    assert list(tmp_path.iterdir()) == []  # refused before anything was made
    allowed, _ = parse_config({"endpoint": "tcp://127.0.0.1:0", "shm_dir": str(tmp_path), "max_hold_s": 5})
    store = start_store(allowed, Shape(WIDTH, 2), log)  # loopback needs no key
    store.close()


def test_a_pull_only_config_binds_nothing_and_an_announced_producer_is_read(tmp_path):
    config, unknown = parse_config({"pull_from": ["10.0.0.0/8", "vitserve-0"], "shm_dir": str(tmp_path)})
    assert (config.endpoint, config.pull_from, unknown) == (None, ("10.0.0.0/8", "vitserve-0"), [])
    store = start_store(config, Shape(WIDTH, 2), logging.getLogger("test"))
    try:
        assert store.endpoint == ""
        assert store.failure_since(0.0) is None
    finally:
        store.close()
    got = parse_announcement(announce(**{U: {**item(), "producer": "tcp://10.0.0.7:5700"}}), DTYPES)
    assert got[U].producer == "tcp://10.0.0.7:5700"
    with pytest.raises(AnnouncementError, match="producer must be a ZMQ endpoint"):
        parse_announcement(announce(**{U: {**item(), "producer": 7}}), DTYPES)


def test_each_data_parallel_engine_core_binds_its_own_push_endpoint_or_is_refused():
    push, _ = parse_config({"endpoint": "tcp://127.0.0.1:5600"})
    assert for_rank(push, 0) == push
    for config in (push, parse_config({"endpoint": "tcp://127.0.0.1:5600", "pull_from": ["127.0.0.1"]})[0]):
        with pytest.raises(
            ValueError, match="run vitserve with --llm_transport pull.*dp_push.*--llm_dp_size"
        ):
            for_rank(config, 1, 1)  # push to one endpoint: vitserve cannot choose the core
    pinned, _ = parse_config({"endpoint": "tcp://127.0.0.1:5600", "dp_push": True})
    assert for_rank(pinned, 0, 0) == pinned
    assert for_rank(pinned, 1, 1).endpoint == "tcp://127.0.0.1:5601"  # vitserve --llm_dp_size pins the rank
    ipc, _ = parse_config({"endpoint": "ipc:///tmp/c.sock", "dp_push": True})
    assert for_rank(ipc, 2).endpoint == "ipc:///tmp/c.sock-2"
    with pytest.raises(ValueError, match="more than one node .*#2, #0 on its node.*--llm_transport pull"):
        for_rank(pinned, 2, 0)  # a second node's first core: vitserve reaches every core at one host
    with pytest.raises(ValueError, match="dp_push must be true or false"):
        parse_config({"endpoint": "tcp://127.0.0.1:5600", "dp_push": "yes"})
    pull, _ = parse_config({})
    assert for_rank(pull, 3) == pull  # nothing bound, nothing to offset
