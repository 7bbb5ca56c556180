"""The encoder-cache hand-over at real widths: vitserve writes one embedding's file, checks it before sending,
and vLLM's ECExampleConnector reads it, against the inline body's build and parse in the same sitting.

    python bench/ec_handover.py            # widths 3,584 and 16,384, one 1080p image (2,700 rows), 5 repeats
    python bench/ec_handover.py --quick    # 2 repeats

Per width, bfloat16 (a GPU tower's dtype), best and median of the repeats:
- write: vitserve.handover.ec_files.write_file (safetensors of the tensor to a temporary name, then a rename);
- check: ec_files.check_file (the header only: the check before every upstream request);
- read: what vLLM's ECExampleConnector does on a cache miss, safetensors.torch.load_file(path)["ec_cache"]
  (on a CPU it memory-maps the file), then a copy into the encoder cache (vLLM copies it into its own tensor
  before the forward; `.clone()` here);
- inline: vitserve.handover.inline_body.dumps_body for the same tensor (what the inline transport builds instead).
The directory is --dir (default /dev/shm, where the two processes share it on one host).

Each run appends its record to bench/out/ec_handover.jsonl and prints RESULTS.md's table. Issue 33's target:
write + read <= 30 ms per 1080p image at width 16,384.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.workloads import TOKENS_1080P  # noqa: E402
from vitserve.handover.ec_files import check_file, file_path, write_file  # noqa: E402
from vitserve.handover.inline_body import InlineTensor, dumps_body  # noqa: E402


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) milliseconds of `repeats` calls."""
    best, median = harness.best_median(harness.timed(fn, repeats))
    return best * 1e3, median * 1e3


def one_width(root: Path, width: int, repeats: int) -> dict[str, float]:
    tensor = torch.randn(TOKENS_1080P, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    uuid = f"{width:064x}"
    path = file_path(root, uuid)

    def write() -> None:
        write_file(root, uuid, tensor, {"bench": "ec_handover"})

    def read() -> torch.Tensor:
        return safetensors.torch.load_file(str(path))["ec_cache"].clone()

    write()
    loaded = read()
    assert torch.equal(loaded, tensor), "the file does not give back the tensor written"
    out: dict[str, float] = {"width": width, "mbytes": tensor.numel() * 2 / 1e6}
    out["write_ms"], out["write_median_ms"] = timed(write, repeats)
    out["check_ms"], out["check_median_ms"] = timed(
        lambda: check_file(root, uuid, TOKENS_1080P, width), repeats
    )
    out["read_ms"], out["read_median_ms"] = timed(read, repeats)
    payload = {"messages": [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": {}}]}]}
    part = payload["messages"][0]["content"][0]["image_embeds"]
    part["image_embeds"] = InlineTensor(tensor)  # type: ignore[index]
    out["inline_build_ms"], out["inline_build_median_ms"] = timed(lambda: dumps_body(payload), repeats)
    out["handover_ms"] = out["write_ms"] + out["check_ms"] + out["read_ms"]
    return out


def main() -> None:
    parser = harness.parser(__doc__, quick="2 repeats instead of 5")
    parser.add_argument("--dir", default="/dev/shm", help="where the files go (the shared storage path)")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    torch.set_num_threads(1)  # the API process's pool thread does the write; vLLM's one reader the read
    run = harness.begin("ec_handover", args)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="vitserve-ec-bench-") as tmp:
        rows = [one_width(Path(tmp), width, repeats) for width in (3584, 16384)]
    rec = {"tokens": TOKENS_1080P, "repeats": repeats, "dir": args.dir, "rows": rows}
    harness.finish(run, rec, args)
    print("| width | MB (bf16) | write | check | read (vLLM) | write + check + read | inline body build |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['width']:,} | {r['mbytes']:.1f} | {r['write_ms']:.1f} ({r['write_median_ms']:.1f}) ms "
            f"| {r['check_ms']:.2f} ms | {r['read_ms']:.1f} ({r['read_median_ms']:.1f}) ms "
            f"| **{r['handover_ms']:.1f} ms** | {r['inline_build_ms']:.1f} ({r['inline_build_median_ms']:.1f}) ms |"
        )
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
