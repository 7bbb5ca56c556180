"""What a fresh interpreter loads, and computes, when it imports one vitserve module. Moved here from
tests/unit, which starts no process (the quick tier, tests/no_processes.py).

A module already imported by this process would hide what it costs, so the checks run in new interpreters:
one (`fresh`) runs them all in turn, lightest first, and records what each step found in sys.modules; each
test reads its step. A step's finding is what a fresh interpreter would find because every step before it is
checked to have loaded none of what that step looks for. (One interpreter per check cost ~10 interpreter
starts, each importing torch and transformers again: ~240 s of this folder at load ~15.) The torchvision
check and `--version` (the CLI itself) keep interpreters of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import vitserve
from tests.cli import Cli
from vitserve.model import load_encoder
from vitserve.processors import load_image_processor

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "zmq", "transformers")

STEPS = textwrap.dedent(
    """
    import json, sys
    found = {}
    def loaded(name, *modules):
        found[name] = {m: m in sys.modules for m in modules}
    def top_level(name, prefixes):
        found[name] = sorted(m for m in sys.modules if m.split(".")[0] in prefixes)

    import vitserve.families
    top_level("vitserve.families", ("torch", "transformers"))
    import vitserve.preflight
    top_level("vitserve.preflight", ("torch", "transformers"))
    import vitserve; vitserve.__version__
    loaded("vitserve", *HEAVY)
    import vitserve.cli
    loaded("vitserve.cli", *HEAVY)
    from vitserve import VitserveClient, EmbeddingReceiver
    loaded("lazy names", "torch", "zmq")
    import vitserve.video.decoder_pool
    loaded("vitserve.video.decoder_pool", "transformers")
    import vitserve.processors.pixels
    loaded("vitserve.processors.pixels", "transformers")
    from vitserve.video import load_video_processor
    loaded("the video processor", "transformers")

    # a whole /encode through the app with tracing off (the default)
    import threading
    from fastapi.testclient import TestClient
    from tests.e2e.live import TEST_CONFIG, png_bytes
    from tests.fakes import thread_engine
    from vitserve.api.app import create_app
    from vitserve.metrics import Metrics
    from vitserve.processors import load_image_processor

    gate = threading.Event(); gate.set()
    metrics = Metrics()
    engine = thread_engine(TEST_CONFIG, metrics, gate=gate)
    processor = load_image_processor("qwen2_5_vl", budget_tokens=TEST_CONFIG.visual_batch_max_tokens)
    app = create_app(TEST_CONFIG, engine, processor, metrics)
    with TestClient(app) as client:
        client.portal.call(engine.start)
        r = client.post("/encode", files=[("images", ("a.png", png_bytes(32, 32), "image/png"))])
        assert r.status_code == 200, r.text
        assert r.headers["traceparent"].startswith("00-"), r.headers
        client.portal.call(engine.shutdown)
    found["tracing off"] = [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                                    "opentelemetry.proto", "google.protobuf"))]
    from vitserve.model import load_encoder
    found["the demo digest"] = load_encoder("demo").weights_digest
    print("FOUND", json.dumps(found))
    """
)


@pytest.fixture(scope="module")
def fresh() -> dict:
    """Every step's finding, from one new interpreter (STEPS)."""
    code = f"HEAVY = {HEAVY!r}\n{STEPS}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("FOUND "))
    return json.loads(line.removeprefix("FOUND "))


@pytest.mark.parametrize("module", ["vitserve.families", "vitserve.preflight"])
def test_the_registry_and_the_preflight_import_no_torch(fresh, module):
    """The CLI checks its flags and the checkpoint with these two before it pays for torch."""
    assert fresh[module] == []


def test_import_vitserve_loads_no_heavy_dependency(fresh):
    assert fresh["vitserve"] == dict.fromkeys(HEAVY, False)


def test_the_lazy_names_do_load_their_modules(fresh):
    """The checks of what is not loaded could pass by never loading anything: here the client's and the
    receiver's names load torch and zmq (not loaded by the steps before), and the video processor's loads
    transformers."""
    assert fresh["vitserve.cli"] == dict.fromkeys(HEAVY, False)  # so the names' step is the one that loads
    assert fresh["lazy names"] == {"torch": True, "zmq": True}
    assert fresh["the video processor"] == {"transformers": True}


def test_version_flag_needs_no_heavy_dependency(fresh, tmp_path):
    assert fresh["vitserve.cli"] == dict.fromkeys(HEAVY, False)
    out = Cli.run(["--version"], tmp_path)
    assert (out.returncode, out.stdout.strip()) == (0, f"vitserve {vitserve.__version__}")


@pytest.mark.parametrize("module", ["vitserve.video.decoder_pool", "vitserve.processors.pixels"])
def test_a_decoder_process_imports_no_transformers(fresh, module):
    """The video decoder processes (spawned) import these two; the package `__init__`s load their names
    lazily, so transformers (~10 s of a decoder's start on 2 cores) is not imported through them."""
    assert fresh[module] == {"transformers": False}


def test_vitserve_needs_no_torchvision():
    """With torchvision unimportable (as in a vitserve install: it is no dependency), the torch backend
    serves: the same pixels as with it installed (where transformers imports it on its own)."""
    code = (
        "import sys; sys.modules['torchvision'] = None\n"  # import torchvision -> ImportError
        "import numpy as np, PIL.Image\n"
        "from vitserve.processors import load_image_processor\n"
        "image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (77, 99, 3), dtype=np.uint8))\n"
        "px = load_image_processor('qwen2_5_vl', 256).preprocess(image).pixel_values\n"
        "sys.stdout.buffer.write(px.numpy().tobytes())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True).stdout
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (77, 99, 3), dtype=np.uint8))
    want = load_image_processor("qwen2_5_vl", 256).preprocess(image).pixel_values
    assert out == want.numpy().tobytes()


def test_off_imports_no_opentelemetry_sdk_or_exporter(fresh):
    """A whole /encode through the app with tracing off (the default) loads neither the OpenTelemetry SDK
    nor its exporter nor protobuf (the step asserts the 200 and its traceparent). (FastAPI itself imports
    opentelemetry's API package.)"""
    assert fresh["tracing off"] == []


def test_the_demo_digest_is_the_same_in_every_process(fresh):
    here = load_encoder("demo").weights_digest
    assert fresh["the demo digest"] == here
    assert len(here) == 64
