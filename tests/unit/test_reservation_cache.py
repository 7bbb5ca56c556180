"""The stored reservation (vitserve/worker/reservation/stored.py, meter.PeakWatch): its key, the stored file, and the live peak
check that invalidates it. The CLI round trip (a warm start skips the stress) is
tests/e2e/test_startup_cache.py."""

from __future__ import annotations

import gc
import logging
import mmap

import pytest
import torch

from vitserve.worker.reservation import Method, PeakWatch, Reservation, StressShape
from vitserve.worker.reservation import stored as cache
from vitserve.worker.reservation.meter import proc_status_kib

CPU = torch.device("cpu")


def _key(weights: str = "ab" * 32, **changes):
    base = {
        "weights": weights,
        "model_name": "demo",
        "family": "qwen2_5_vl",
        "dtype": torch.float32,
        "device": CPU,
        "tp": 1,
        "rank": 0,
        "shape": StressShape(8192, 64, max_image_tokens=16384),
    }
    return cache.cache_key(**{**base, **changes})


ENTRY = Reservation(123_456_789, Method.EXTRAPOLATED, tokens=8192, images=1, detail="3 shapes")


def test_a_stored_entry_is_found_under_the_same_key(tmp_path):
    path = cache.cache_path(tmp_path, "cpu", 3)
    assert path.name == "reservation_cache_cpu_3.json"
    cache.store(path, _key(), ENTRY)
    assert cache.load(path, _key()) == ENTRY  # every field but the per-process baseline comes back
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # atomic: no temp file left behind


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"shape": StressShape(4096, 64, max_image_tokens=16384)}, "visual_batch_max_tokens 8192 -> 4096"),
        ({"tp": 2}, "tp 1 -> 2"),
        ({"dtype": torch.bfloat16}, "dtype 'float32' -> 'bfloat16'"),
        ({"shape": StressShape(8192, 8, max_image_tokens=16384)}, "visual_infer_batch_size 64 -> 8"),
        ({"shape": StressShape(8192, 64, max_image_tokens=4096)}, "max_image_tokens 16384 -> 4096"),
        ({"family": "qwen2_vl"}, "family 'qwen2_5_vl' -> 'qwen2_vl'"),
    ],
)
def test_any_change_measures_again_and_the_warning_names_it(tmp_path, caplog, change, named):
    path = cache.cache_path(tmp_path, "cpu", 0)
    cache.store(path, _key(), ENTRY)
    with caplog.at_level(logging.WARNING, logger=cache.__name__):
        assert cache.load(path, _key(**change)) is None
    assert named in caplog.text


def test_the_versions_are_part_of_the_key():
    import transformers

    import vitserve

    key = _key()
    assert (key["vitserve"], key["torch"], key["transformers"]) == (
        vitserve.__version__,
        torch.__version__,
        transformers.__version__,
    )
    assert key["device"]
    assert key["threads"] == torch.get_num_threads()


@pytest.mark.parametrize(
    "content", ["", "{", "[]", '{"key": {}}', '{"key": {}, "reservation": {"bytes": 1}}']
)
def test_an_unreadable_file_measures_again(tmp_path, content):
    path = cache.cache_path(tmp_path, "cpu", 0)
    path.write_text(content)
    assert cache.load(path, _key()) is None


def test_a_live_peak_above_the_reservation_warns_once_and_drops_the_entry(tmp_path, caplog):
    path = cache.cache_path(tmp_path, "cpu", 0)
    cache.store(path, _key(), ENTRY)
    # freed now, not after the baseline: garbage of earlier tests in this process (whichever ran before it on
    # its xdist worker), collected between the two reads, would shrink the RSS under the 64 MiB ballast
    gc.collect()
    rss = proc_status_kib("VmRSS") * 1024
    within = PeakWatch(CPU, baseline=rss, published=1 << 40, cache_file=path)
    within.check()
    assert path.exists()
    above = PeakWatch(CPU, baseline=rss, published=0, cache_file=path)
    with caplog.at_level(logging.WARNING, logger=cache.__name__), mmap.mmap(-1, 64 << 20) as ballast:
        # 64 MiB of new pages, touched: VmHWM grows past the baseline. Not a tensor: with glibc's mmap threshold
        # pinned by an earlier test in this process (vitserve.model.fast_alloc), it could reuse heap pages that
        # are already resident, and the RSS would not grow (a failure seen under xdist)
        ballast.write(b"\1" * len(ballast))
        above.check()
        above.check()
    assert not path.exists()
    assert caplog.text.count("exceeds the 0 bytes reserved") == 1
