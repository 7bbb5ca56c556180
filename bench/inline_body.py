"""The inline hand-over at real widths: building the chat body (vitserve) and parsing it (vLLM), before/after.

    python bench/inline_body.py             # widths 3,584 and 16,384, one 1080p image (2,700 rows), 3 repeats
    python bench/inline_body.py --quick     # 1 repeat

One image's embedding, (2,700, width), in bfloat16 (a GPU tower's dtype) and float32 (the CPU's). Per width
and dtype, best of the repeats, both code paths in one sitting:
- before: the code before issue 33 (`.npy` of the tensor widened to float32, base64 with the stdlib, the
  string through json.dumps; kept here as `before_body`);
- after: vitserve.handover.inline_body.dumps_body (bf16 as torch.save bytes, base64 spliced into the JSON).

vLLM's side runs in the vLLM venv (scripts/vllm-env.sh; env VITSERVE_TEST_VLLM_PYTHON wins) on the bodies
written to a temporary directory: what its OpenAI server does with one, json.loads (Starlette's
Request.json), ChatCompletionRequest.model_validate, then its own ImageEmbeddingMediaIO.load_base64 on the
part, checked equal to the tensor that was sent; the bodies interleaved (parsing one right after another of
its size was measured ~30% slower than the same parse interleaved: the allocator's state, not the format).

Each run appends its record to bench/out/inline_body.jsonl and prints RESULTS.md's table.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # both halves: the vLLM venv's imports only bench.harness's standard library

from bench import harness  # noqa: E402

GRID = [1, 2 * 45, 2 * 60]  # a 1080p image: 45 x 60 merged = 2,700 rows (workloads.TOKENS_1080P)


def before_body(payload: dict, tensor) -> bytes:  # type: ignore[no-untyped-def]
    """The chat body as vitserve built it before issue 33 (api/embeds.py npy_b64 + api/chat.py _dumps)."""
    import numpy as np
    import torch

    t = tensor.float() if tensor.dtype == torch.bfloat16 else tensor
    buf = io.BytesIO()
    np.lib.format.write_array(buf, t.detach().cpu().contiguous().numpy(), allow_pickle=False)
    text = base64.b64encode(buf.getbuffer()).decode("ascii")
    _part(payload)["image_embeds"]["image_embeds"] = text
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def after_body(payload: dict, tensor) -> bytes:  # type: ignore[no-untyped-def]
    from vitserve.handover.inline_body import InlineTensor, dumps_body

    _part(payload)["image_embeds"]["image_embeds"] = InlineTensor(tensor)
    return dumps_body(payload)


def _payload() -> dict:
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": None, "image_grid_thw": GRID}}
    content = [part, {"type": "text", "text": "what is in it?"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8}


def _part(payload: dict) -> dict:
    return payload["messages"][0]["content"][0]


def _best(fn, repeats: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def sender(widths: list[int], repeats: int, out_dir: Path) -> list[dict]:
    import torch

    from bench.workloads import TOKENS_1080P

    rows = []
    for width in widths:
        for dtype in (torch.bfloat16, torch.float32):
            tensor = torch.randn(TOKENS_1080P, width).to(dtype)
            torch.save(tensor, out_dir / f"{width}-{dtype}.pt")
            for path, build in (("before", before_body), ("after", after_body)):
                seconds, body = _best(lambda build=build, tensor=tensor: build(_payload(), tensor), repeats)
                name = out_dir / f"{width}-{dtype}-{path}.json"
                name.write_bytes(body)  # type: ignore[arg-type]
                rows.append({"width": width, "dtype": str(dtype).split(".")[1], "path": path,
                             "body_mb": round(len(body) / 1e6, 1), "sender_s": round(seconds, 4),  # type: ignore[arg-type]
                             "file": name.name, "tensor": f"{width}-{dtype}.pt"})  # fmt: skip
                del body
    return rows


def vllm_side(out_dir: Path, repeats: int) -> None:
    """In the vLLM venv: time vLLM's own parsing of each body; prints {file: seconds}."""
    import torch
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.multimodal.media.image import ImageEmbeddingMediaIO

    rows = json.loads((out_dir / "rows.json").read_text())
    times: dict[str, float] = {}
    for repeat in range(
        repeats
    ):  # interleaved: each body parsed once per round, the order flipped each round
        for row in harness.alternate(rows, repeat):
            body = (out_dir / row["file"]).read_bytes()
            t0 = time.perf_counter()
            request = ChatCompletionRequest.model_validate(json.loads(body))
            part = request.messages[0]["content"][0]  # type: ignore[index]
            got = ImageEmbeddingMediaIO().load_base64("", part["image_embeds"]["image_embeds"])
            seconds = time.perf_counter() - t0
            times[row["file"]] = round(min(seconds, times.get(row["file"], seconds)), 4)
            want = torch.load(out_dir / row["tensor"], weights_only=True)
            assert torch.equal(got.to(want.dtype), want), row
            del body, request, part, got
    print(json.dumps(times))


def _vllm_python() -> str:
    return os.environ.get("VITSERVE_TEST_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


def table(rows: list[dict]) -> list[str]:
    out = ["| width | dtype | body before / after (MB) | vitserve builds it, before / after (s) | ratio | "
           "vLLM parses it, before / after (s) | ratio |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for b, a in zip(rows[::2], rows[1::2], strict=True):
        out.append(
            f"| {b['width']:,} | {b['dtype']} | {b['body_mb']} / {a['body_mb']} | {b['sender_s']:.3f} / "
            f"{a['sender_s']:.3f} | **{a['sender_s'] / b['sender_s']:.2f}x** | {b['vllm_s']:.3f} / "
            f"{a['vllm_s']:.3f} | **{a['vllm_s'] / b['vllm_s']:.2f}x** |"
        )
    return out


def main() -> None:
    ap = harness.parser(__doc__, quick="one repeat")
    ap.add_argument("--widths", default="3584,16384")
    ap.add_argument("--vllm-side", help=argparse.SUPPRESS)  # the vLLM venv's half: a directory of bodies
    args = ap.parse_args()
    repeats = 1 if args.quick else 3
    if args.vllm_side:
        vllm_side(Path(args.vllm_side), repeats)
        return
    run = harness.begin("inline_body", args)
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="vitserve-inline-", dir=shm if shm.is_dir() else None) as tmp:
        rows = sender([int(w) for w in args.widths.split(",")], repeats, Path(tmp))
        (Path(tmp) / "rows.json").write_text(json.dumps(rows))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        argv = [_vllm_python(), __file__, "--vllm-side", tmp] + (["--quick"] if args.quick else [])
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise SystemExit(f"vLLM side failed:\n{done.stderr[-3000:]}")
        times = json.loads(done.stdout.strip().splitlines()[-1])
    for row in rows:
        row["vllm_s"] = times[row.pop("file")]
        row.pop("tensor")
    print("\n".join(table(rows)))
    harness.finish(run, {"rows": rows}, args)


if __name__ == "__main__":
    main()
