"""atheris target for docs/design.md invariant 14, run by tests/unit/test_fuzz_decode.py in a subprocess (libFuzzer exits
the process on a finding, so it cannot run inside pytest).

    python -m tests.unit.fuzz_decode_target [libFuzzer flags] CORPUS_DIR

Every input goes through what the API does to an uploaded image (vitserve/api/preprocess.py): decode_image,
then the processor's preprocess on what decoded. Only the documented typed errors may escape; anything
else is re-raised, so atheris saves the input (-artifact_prefix) and exits non-zero.
"""

from __future__ import annotations

import sys

import atheris
import torch  # noqa: F401  (imported, not instrumented: only vitserve and PIL are)
import transformers  # noqa: F401

with atheris.instrument_imports(include=["vitserve", "PIL"]):  # coverage feedback from their Python code
    import PIL.Image  # noqa: F401

    from vitserve.errors import (
        AspectRatioTooLarge,
        ImageTooSmall,
        InvalidImage,
        OverTokenBudget,
        PayloadTooLarge,
        VitserveError,
    )
    from vitserve.images import decode_image
    from vitserve.processors import load_image_processor

MAX_IMAGE_PIXELS = 1 << 20  # small, so the header check (PayloadTooLarge) is reached and inputs stay fast
BUDGET_TOKENS = 256
DECODE_ERRORS = (InvalidImage, PayloadTooLarge)  # decode_image's docstring
PREPROCESS_ERRORS = (ImageTooSmall, AspectRatioTooLarge, OverTokenBudget)  # VisionProcessor.plan's docstring

PROCESSOR = load_image_processor("qwen2_5_vl", budget_tokens=BUDGET_TOKENS)
_counts = {"decoded": 0, "preprocessed": 0}


def _count(key: str) -> None:
    """libFuzzer exits without running Python's atexit, so progress goes to stderr at powers of two."""
    _counts[key] += 1
    n = _counts[key]
    if n & (n - 1) == 0:
        print(f"fuzz-count {key} {n}", file=sys.stderr, flush=True)


def test_one_input(data: bytes) -> None:
    try:
        decoded = decode_image(data, max_image_pixels=MAX_IMAGE_PIXELS)
    except DECODE_ERRORS:
        return
    _count("decoded")
    try:
        PROCESSOR.preprocess(decoded.image)
        _count("preprocessed")
    except PREPROCESS_ERRORS:
        return
    except VitserveError as exc:
        # call_hf wraps an HF failure in a plain VitserveError (documented, but a 500): for an image that
        # decoded cleanly it is a finding, not an allowed outcome.
        raise AssertionError(f"the HF processor failed on a decoded image: {exc}") from exc
    finally:
        decoded.image.close()


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
