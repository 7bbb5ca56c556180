"""A few hundred real-world-like and broken image files through a real server (uvicorn on an ephemeral port,
the real Engine over a tiny Qwen2.5-VL checkpoint): valid files 200 with the right sizes, bad files their
documented 4xx code, never a 5xx, no traceback or decoder noise in the server log, bounded RSS.

The pixels of the tricky modes are checked against numpy references in tests/unit/test_decode_rules.py
(same corpus, tests/image_corpus.py); here the HTTP answer is checked.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.e2e.live import live_server, real_engine_options
from tests.image_corpus import Sample, flipped, polyglot_samples, refused_samples, valid_samples

pytestmark = pytest.mark.timeout(600)
DOCUMENTED_4XX = {
    400: {"invalid_image", "unsupported_image", "image_too_small", "aspect_ratio_too_large"},
    413: {"payload_too_large", "over_token_budget"},
}
BATCH = 8  # valid images per request


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    options = real_engine_options(tmp_path_factory.mktemp("corpus"))
    with live_server(**options) as srv:
        yield srv


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:  # the server runs in this process (tests/e2e/live.py)
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _post(client: httpx.Client, samples: list[Sample]) -> httpx.Response:
    files = [("images", (s.name, s.data, "application/octet-stream")) for s in samples]
    return client.post("/encode", files=files)


def _check_valid(client, live, samples: list[Sample]) -> None:
    for start in range(0, len(samples), BATCH):
        group = samples[start : start + BATCH]
        r = _post(client, group)
        assert r.status_code == 200, (r.status_code, r.text, [s.name for s in group])
        for sample, img in zip(group, r.json()["images"], strict=True):
            assert tuple(img["original_size"]) == sample.size, sample.name
            assert tuple(img["resized_size"]) == live.service.processor.plan(*sample.size).resized_size, (
                sample.name
            )


def _check_refused(client, samples: list[Sample]) -> None:
    for sample in samples:
        r = _post(client, [sample])
        assert r.status_code < 500, (sample.name, r.status_code, r.text)
        if sample.code == "any":  # bit-flipped: 200 or a documented 4xx, nothing else
            if r.status_code != 200:
                assert r.json()["error"]["code"] in DOCUMENTED_4XX.get(r.status_code, ()), (
                    sample.name,
                    r.text,
                )
            continue
        assert r.status_code == sample.status, (sample.name, r.text)
        err = r.json()["error"]
        assert err["code"] == sample.code, (sample.name, err)
        assert err["image_index"] == 0


def _run_corpus(live, valid, refused, capfd, caplog) -> None:
    caplog.set_level(logging.INFO)  # what a server at the default --log_level would print
    with live.client(timeout=120) as client:
        _check_valid(client, live, valid[:BATCH])  # warm-up: first decode of each codec, first encode
        _check_refused(client, refused[:BATCH])
        before = _rss_bytes()
        for _ in range(2):
            _check_valid(client, live, valid)
            _check_refused(client, refused)
        after = _rss_bytes()
    grew = after - before
    # two passes over the corpus: a leak of even one small decoded image per file would show as several MiB;
    # the bound leaves room for allocator arenas of the decode threads
    assert grew < 64 * 2**20, f"server RSS grew by {grew / 2**20:.1f} MiB over two passes"
    out, err = capfd.readouterr()
    for text in (out, err, caplog.text):
        assert "Traceback" not in text
        for noise in (
            "TIFFReadDirectory",
            "compression support is not configured",
            "UserWarning",
            "More samples per pixel",
        ):
            assert noise not in text
    loud = [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(("vitserve", "PIL"))
    ]
    assert not loud, [r.getMessage() for r in loud]


def test_corpus_over_http(live, capfd, caplog):
    valid = valid_samples(range(1), sizes=((37, 29),)) + polyglot_samples()
    refused = refused_samples() + flipped(valid, 50)
    assert len(valid) + len(refused) >= 190
    _run_corpus(live, valid, refused, capfd, caplog)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bigger_corpus_over_http(live, capfd, caplog):
    valid = valid_samples(range(2, 6), sizes=((23, 17), (64, 48), (301, 199), (640, 480), (3, 300)))
    refused = refused_samples() + flipped(valid, 400, seed=1)
    _run_corpus(live, valid, refused, capfd, caplog)
