"""What a fresh interpreter loads, and computes, when it imports one vitserve module: each check runs
`python -c` in a new process (a module already imported by this one would hide what it costs). Moved here
from tests/unit, which starts no process (the quick tier, tests/no_processes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

import vitserve
from tests.cli import Cli
from vitserve.model import load_encoder
from vitserve.processors import load_image_processor

pytestmark = pytest.mark.timeout(300)
HEAVY = ("torch", "zmq", "transformers")


def _loaded_modules(module: str, prefixes: tuple[str, ...]) -> str:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in {prefixes!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("module", ["vitserve.families", "vitserve.preflight"])
def test_the_registry_and_the_preflight_import_no_torch(module):
    """The CLI checks its flags and the checkpoint with these two before it pays for torch."""
    assert _loaded_modules(module, ("torch", "transformers")).strip() == "[]"


def _loaded_after(code: str) -> dict:
    probe = f"import json, sys; {code}; print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout)


def test_import_vitserve_loads_no_heavy_dependency():
    assert _loaded_after("import vitserve; vitserve.__version__") == dict.fromkeys(HEAVY, False)


def test_the_lazy_names_do_load_their_modules():
    """The checks of what is not loaded could pass by never loading anything: here the client's and the
    receiver's names load torch and zmq, and the video processor's loads transformers (one interpreter for
    both: each start costs ~5 s of imports)."""
    code = textwrap.dedent(
        """
        import json, sys
        from vitserve import VitserveClient, EmbeddingReceiver
        print(json.dumps([m in sys.modules for m in ("torch", "zmq")]))
        from vitserve.video import load_video_processor
        print(json.dumps("transformers" in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    names, video = (json.loads(line) for line in out.stdout.splitlines())
    assert names == [True, True]
    assert video


def test_version_flag_needs_no_heavy_dependency(tmp_path):
    assert _loaded_after("import vitserve.cli") == dict.fromkeys(HEAVY, False)
    out = Cli.run(["--version"], tmp_path)
    assert (out.returncode, out.stdout.strip()) == (0, f"vitserve {vitserve.__version__}")


@pytest.mark.parametrize("module", ["vitserve.video.decoder_pool", "vitserve.processors.pixels"])
def test_a_decoder_process_imports_no_transformers(module):
    """The video decoder processes (spawned) import these two; the package `__init__`s load their names
    lazily, so transformers (~10 s of a decoder's start on 2 cores) is not imported through them."""
    assert not _loaded_after(f"import {module}")["transformers"]


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


def test_off_imports_no_opentelemetry_sdk_or_exporter():
    """A whole /encode through the app with tracing off (the default) loads neither the OpenTelemetry SDK
    nor its exporter nor protobuf. (FastAPI itself imports opentelemetry's API package.)"""
    code = textwrap.dedent(
        """
        import sys
        from fastapi.testclient import TestClient
        from tests.e2e.live import TEST_CONFIG, png_bytes
        from tests.fakes import thread_engine
        import threading
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
        loaded = [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                          "opentelemetry.proto", "google.protobuf"))]
        print("LOADED", loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED []" in out.stdout, out.stdout


def test_the_demo_digest_is_the_same_in_every_process():
    code = "from vitserve.model import load_encoder; print(load_encoder('demo').weights_digest)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = load_encoder("demo").weights_digest
    assert out.stdout.strip().splitlines()[-1] == here
    assert len(here) == 64
