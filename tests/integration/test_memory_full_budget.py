"""docs/design.md invariant 7: batches that fill the token budget exactly stay within the published reservation (CPU: RSS).

A real Engine (tp=1) loads a tiny real checkpoint with the production load_encoder, reserves at start-up
(vitserve/worker/reservation/: malloc_trim, reset VmHWM, the production forward on the full-budget stress
batches, publish the VmRSS growth times HEAP_FACTOR) and then serves many batches whose tokens sum to EXACTLY the budget, in every composition the
scheduler can form: one image of B tokens, a long thin one, equal halves / quarters, the image-count cap,
and a mix. The worker's peak RSS over the whole run (VmHWM, never reset after the stress) minus the RSS it
had just before the stress (logged by the reservation) must stay within the published bytes, plus one
page-level slack.

The "before" comes from the worker's own log line, read through the inherited stderr (capfd); the test does
not derive it from the published number, so publishing too little fails it (checked by hand: halving the
published bytes makes the growth exceed them by tens of MiB).
"""

from __future__ import annotations

import re
import types

import pytest

from tests.checkpoints import VISION_CONFIGS, make_checkpoint
from tests.integration.engine_helpers import deadline, encode, make_config, running_engine
from vitserve.contract import ProcessedImage
from vitserve.reservation_file import read_reservation
from vitserve.worker.reservation.worst_case import qwen_item

BUDGET = 1024  # merged tokens per batch
MAX_IMAGES = 8  # --visual_infer_batch_size
ROUNDS = 3  # every composition is served this many times: fragmentation shows on repeats
SLACK_BYTES = 1 << 20  # VmHWM moves in pages; the reservation already holds the measured worst case
_STRESS_LINE = re.compile(r"CPU stress: VmRSS (\d+) KiB before, VmHWM (\d+) KiB after")

# (rows, cols) in merged tokens; each list sums to BUDGET exactly
COMPOSITIONS = {
    "one_square": [(32, 32)],
    "one_thin": [(4, 256)],
    "halves": [(16, 32)] * 2,
    "quarters": [(16, 16)] * 4,
    "max_images": [(8, 16)] * MAX_IMAGES,
    "mixed": [(16, 32), (16, 16), (8, 16), (8, 8), (8, 8)],
}


def _item(family: str, rows: int, cols: int, seed: int) -> ProcessedImage:
    """What the processor hands the engine for a (rows x cols)-token image (the stress batches' own items)."""
    return qwen_item(types.SimpleNamespace(**VISION_CONFIGS[family]), (rows, cols), seed)


def _vm_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])  # "VmHWM:   123456 kB"
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _stress_baseline_kib(stderr: str) -> int:
    found = _STRESS_LINE.findall(stderr)
    assert len(found) == 1, f"expected one CPU stress log line from the worker, got {found!r}"
    return int(found[0][0])


@pytest.mark.parametrize("family", ["qwen2_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.slow)])
async def test_full_budget_batches_stay_within_published_reservation(tmp_path, capfd, family):
    assert all(sum(r * c for r, c in shape) == BUDGET for shape in COMPOSITIONS.values())
    assert max(len(shape) for shape in COMPOSITIONS.values()) == MAX_IMAGES
    ckpt = make_checkpoint(family, tmp_path / "ckpt")
    config = make_config(
        tmp_path,
        model=str(ckpt),
        tp=1,
        dtype="float32",
        visual_batch_max_tokens=BUDGET,
        visual_infer_batch_size=MAX_IMAGES,
        log_level="info",
    )
    async with running_engine(config, factory=None) as engine:  # None: the production load_configured_encoder
        (pid,) = engine.worker_pids()[0]
        published = read_reservation(config.runtime_dir, "cpu", 0)
        assert published is not None
        assert (published["source"], published["pid"]) == ("stress", pid)
        assert engine.info().reserved_memory_bytes == {0: published["bytes"]}
        hwm_ready = _vm_kib(pid, "VmHWM")

        seed = 0
        for _ in range(ROUNDS):
            for name, shape in COMPOSITIONS.items():
                items = [_item(family, r, c, seed := seed + 1) for r, c in shape]
                results = await encode(
                    engine,
                    name,
                    items,
                    [f"{name}{i}" for i in range(len(items))],
                    deadline=deadline(60),
                    return_embeddings=False,
                )
                assert sum(res.num_tokens for res in results) == BUDGET
        assert engine.metrics.value("vitserve_images_total", outcome="encoded") == ROUNDS * sum(
            len(shape) for shape in COMPOSITIONS.values()
        )
        hwm_after = _vm_kib(pid, "VmHWM")

    baseline = _stress_baseline_kib(capfd.readouterr().err)
    reserved = published["bytes"]
    growth = (hwm_after - baseline) * 1024
    mib = 1 << 20
    print(
        f"{family}: reserved {reserved / mib:.1f} MiB; peak RSS growth over the pre-stress RSS: "
        f"{(hwm_ready - baseline) * 1024 / mib:.1f} MiB after READY, {growth / mib:.1f} MiB after "
        f"{ROUNDS * len(COMPOSITIONS)} full-budget batches"
    )
    assert reserved > 0
    assert growth <= reserved + SLACK_BYTES, (
        f"peak RSS grew {growth} bytes over the pre-stress RSS under full-budget batches, above the published "
        f"reservation of {reserved} bytes (+{SLACK_BYTES} slack)"
    )
