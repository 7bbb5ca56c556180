"""The encoder-cache hand-over at real widths: vitserve writes one embedding's file, checks it before sending,
and vLLM's ECExampleConnector reads it, against the wire hand-over (`--llm_transport wire`: pushed over ZMQ to
vitserve's own connector) and the inline body's build, in the same sitting.

    python bench/ec_handover.py            # widths 3,584 and 16,384, one 1080p image (2,700 rows), 5 repeats
    python bench/ec_handover.py --quick    # 2 repeats

Per width, bfloat16 (a GPU tower's dtype), best and median of the repeats:
- write: vitserve.handover.ec_files.write_file (safetensors of the tensor to a temporary name, then a rename);
- check: ec_files.check_file (the header only: the check before every upstream request);
- read: what vLLM's ECExampleConnector does on a cache miss, safetensors.torch.load_file(path)["ec_cache"]
  (on a CPU it memory-maps the file), then a copy into the encoder cache (vLLM copies it into its own tensor
  before the forward; `.clone()` here);
- inline: vitserve.handover.inline_body.dumps_body for the same tensor (what the inline transport builds instead);
- wire push: a real vitserve.rpc.sender.LLMSender sends the embedding (width 16,384: Qwen3-VL-8B's 4,096 main
  columns and 3 DeepStack levels of 4,096, as vitserve sends them) on TCP loopback to a real
  vitserve.connector.store.EmbeddingStore (the receiving side of vitserve.vllm_connector), which checks it, keeps it
  as a raw file in /dev/shm and acknowledges it: the time from send to the delivery's acknowledgement;
- wire load: what vLLM's worker does with it, vitserve.connector.store.read_entry of that file into a tensor of its
  own (one read(2) into the tensor; before, it mapped the file copy-on-write and this bench added a .clone()).
The directory is --dir (default /dev/shm, where the two processes share it on one host).

Each run appends its record to bench/out/ec_handover.jsonl and prints RESULTS.md's table. Issue 33's target:
write + read <= 30 ms per 1080p image at width 16,384.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.workloads import TOKENS_1080P  # noqa: E402
from vitserve.connector.store import EmbeddingStore, Shape, as_dict, read_entry  # noqa: E402
from vitserve.handover.ec_files import check_file, file_path, write_file  # noqa: E402
from vitserve.handover.inline_body import InlineTensor, dumps_body  # noqa: E402
from vitserve.rpc.sender import LLMSender  # noqa: E402
from vitserve.rpc.wire import ImageEmbedding  # noqa: E402

GRID_1080P = (1, 60, 180)  # a patch grid whose 2x2 merge gives TOKENS_1080P rows
QWEN3_HIDDEN = 4096  # width 16,384 = Qwen3-VL-8B's hidden size x (1 + 3 DeepStack levels)


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
    out["handover_median_ms"] = out["write_median_ms"] + out["check_median_ms"] + out["read_median_ms"]
    out.update(wire(tensor, root, repeats))
    return out


def wire(tensor: torch.Tensor, root: Path, repeats: int) -> dict[str, float]:
    """The wire hand-over of `tensor` (see the module docstring): push + acknowledgement, then the worker's load."""
    width = tensor.shape[1]
    split = [QWEN3_HIDDEN] * (width // QWEN3_HIDDEN) if width % QWEN3_HIDDEN == 0 else [width]
    parts = [p.contiguous() for p in torch.split(tensor, split, dim=1)]
    ids = (f"{width:08x}{n:056x}" for n in itertools.count())
    pushes, loads = [], []
    store = EmbeddingStore("tcp://127.0.0.1:*", 4 << 30, Shape(width, 2), directory=str(root))
    with contextlib.closing(store), LLMSender(store.endpoint) as sender:
        assert sender.wait_reachable(30), f"no connection to the store on {store.endpoint}"
        for i in range(repeats + 1):  # the first: connection and allocation costs, not timed
            uuid = next(ids)
            message = ImageEmbedding(request_id=f"bench-{i}", image_index=0, num_images=1, image_id=uuid,
                                     grid_thw=GRID_1080P, embedding=parts[0], deepstack=parts[1:], uuid=uuid)  # fmt: skip
            t0 = time.perf_counter()
            sender.send(message, deadline=time.monotonic() + 60).wait(60)
            t1 = time.perf_counter()
            entry = store.get(uuid)
            assert entry is not None, "acknowledged, yet the store does not hold it"
            where = as_dict(entry)
            loaded = read_entry(where["path"], where["dtype"], where["rows"], where["width"])
            t2 = time.perf_counter()
            if i == 0:
                assert torch.equal(loaded, tensor), "the connector's file does not give back the tensor sent"
            else:
                pushes.append(t1 - t0)
                loads.append(t2 - t1)
            store.unpin({uuid}, f"bench-{i}")  # loaded: spent, so the bound may evict it
    out: dict[str, float] = {}
    for name, times in (("push", pushes), ("load", loads)):
        best, median = harness.best_median(times)
        out[f"wire_{name}_ms"], out[f"wire_{name}_median_ms"] = best * 1e3, median * 1e3
    out["wire_ms"] = out["wire_push_ms"] + out["wire_load_ms"]
    out["wire_median_ms"] = out["wire_push_median_ms"] + out["wire_load_median_ms"]
    return out


def table(rows: list[dict]) -> list[str]:
    """Best (median) ms per 1080p image: ec_storage's write, check and read beside the wire's push and load."""
    out = ["| width | MB (bf16) | write | check | read (vLLM) | write + check + read | wire push + ack "
           "| wire load (vLLM) | wire push + load | inline body build |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:

        def cell(k: str, r: dict = r) -> str:
            return f"{r[k + '_ms']:.1f} ({r[k + '_median_ms']:.1f}) ms"

        out.append(f"| {r['width']:,} | {r['mbytes']:.1f} | {cell('write')} | {r['check_ms']:.2f} ms | {cell('read')} "
                   f"| **{cell('handover')}** | {cell('wire_push')} | {cell('wire_load')} | **{cell('wire')}** "
                   f"| {cell('inline_build')} |")  # fmt: skip
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
    print("\n".join(table(rows)))
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
