"""docs/design.md invariant 14: atheris on the decode path (time-boxed); only the documented error types escape.

The fuzzer (tests/unit/fuzz_decode_target.py) runs in a subprocess, seeded with one small valid image of
every allowed format (and the modes decode_image converts: alpha, 16-bit, grey, palette). A finding makes
libFuzzer save the input under tmp_path and exit non-zero; the test then fails naming that file.
Needs the `fuzz` extra (pip install -e '.[fuzz]'); skipped without atheris.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

MAX_TOTAL_TIME_S = 60
MAX_RUNS = 500_000


def _seed_images() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))
    seeds = {}
    for fmt in ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"):
        buf = io.BytesIO()
        rgb.save(buf, format=fmt)
        seeds[f"rgb.{fmt.lower()}"] = buf.getvalue()
    extra = {
        "rgba.png": (rgb.convert("RGBA"), "PNG"),
        "grey.jpeg": (rgb.convert("L"), "JPEG"),
        "palette.gif": (rgb.convert("P"), "GIF"),
        "i16.png": (Image.fromarray(rng.integers(0, 65536, (24, 40), dtype=np.uint16)), "PNG"),
        "float.tiff": (Image.fromarray(rng.random((24, 40), dtype=np.float32)), "TIFF"),
    }
    for name, (img, fmt) in extra.items():
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        seeds[name] = buf.getvalue()
    return seeds


@pytest.mark.slow
@pytest.mark.timeout(MAX_TOTAL_TIME_S + 120)
def test_only_documented_errors_escape_the_decode_path(tmp_path):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, data in _seed_images().items():
        (corpus / name).write_bytes(data)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    repo = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "tests.unit.fuzz_decode_target",
        f"-max_total_time={MAX_TOTAL_TIME_S}",
        f"-runs={MAX_RUNS}",
        "-timeout=20",
        "-rss_limit_mb=4096",
        "-max_len=65536",
        f"-artifact_prefix={artifacts}/",
        str(corpus),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=MAX_TOTAL_TIME_S + 90
    )
    log = proc.stderr[-6000:]
    found = sorted(p.name for p in artifacts.iterdir())
    assert (proc.returncode, found) == (0, []), (
        f"the fuzzer found an input that escapes with an undocumented error (rc {proc.returncode}); "
        f"saved: {[str(artifacts / f) for f in found]}\n{log}"
    )
    runs = [line for line in proc.stderr.splitlines() if "Done" in line and "runs" in line]
    assert runs, f"atheris did not report its run count:\n{log}"
    preprocessed = [
        int(line.split()[-1])
        for line in proc.stderr.splitlines()
        if line.startswith("fuzz-count preprocessed")
    ]
    assert preprocessed, f"no fuzzed input reached the processor (the seeds should):\n{log}"
    print(f"{runs[-1]}; inputs that decoded and preprocessed: at least {max(preprocessed)}")
