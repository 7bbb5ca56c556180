"""tests/unit: in-process tests. They start no process (tests/no_processes.py fails one that does); those not
marked `heavy` (HEAVY below) are the quick tier, `bash scripts/test.sh --quick`."""

from __future__ import annotations

import pytest

from tests import no_processes
from tests.parallel import folder

# Unit tests left out of the quick tier (marked `heavy`; the default run keeps them), each for what costs:
# a module (its file name) or one test (file::name). Together ~45% of tests/unit's CPU time.
HEAVY = {
    "test_equivalence.py": "every family's tower against the Hugging Face model loaded by from_pretrained",
    "test_loader.py": "loads every family's tower from tiny checkpoints and runs it",
    "test_fast.py": "the optimized towers' forwards against HF's",
    "test_fast_linear.py": "oneDNN linear layers against F.linear",
    "test_fast_tp.py": "the optimized attention under simulated TP shards",
    "test_pixels_torch.py": "transformers' torchvision processors as the oracle",
    "test_checkpoint.py": "tiny checkpoints written by save_pretrained, and digests of their weights",
    "test_jpeg_draft.py::test_draft_keeps_the_full_paths_plan": "40 JPEG decodes at full size",
    "test_video_decode.py::test_a_truncated_stream_is_never_returned_short": "decodes a video over and over",
    "test_reservation.py::test_concurrent_reader_never_sees_a_partial_file": "300 file replaces raced by a reader",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if folder(item) != "unit":
            continue
        name = item.path.name
        if name in HEAVY or f"{name}::{item.originalname}" in HEAVY:
            item.add_marker(pytest.mark.heavy)


def pytest_configure(config):
    no_processes.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with no_processes.guard():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with no_processes.guard():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with no_processes.guard():
        return (yield)
