"""bench/preprocess.py measures vitserve's fast path against the HF processor it equals: one of its rounds on
a small photo-like JPEG, through the bench's own code. Its pixels must equal HF's (it refuses to time
anything else), which a change of the default --image_resize once broke unnoticed: no timing is asserted."""

from __future__ import annotations

from bench import preprocess
from bench.workloads import SMALL_SIZE, jpeg_bytes, photo_like


def test_a_round_of_the_preprocessing_bench_compares_equal_pixels():
    blob = jpeg_bytes(photo_like(*SMALL_SIZE, seed=2))
    row = preprocess.measure("jpeg_224", blob, 256, reps=1)
    assert row["tokens"] > 0
    assert row["ratio"] > 0
