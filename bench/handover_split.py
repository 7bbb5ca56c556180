"""The wire hand-over split copy by copy (issue 51): for one image's bf16 embedding at 448 px (256 rows) and 1080p
(2,700 rows), widths 3,584 and 16,384, the time of each copy the hand-over makes, of the whole, and of memcpy of
the same bytes in the same sitting (the physical floor).

    python bench/handover_split.py            # 5 repeats
    python bench/handover_split.py --quick    # 2 repeats

Per point, best and median of the repeats, one thread (vitserve's pool thread sends; vLLM's one worker reads):
- memcpy: `dst.copy_(src)` into a tensor allocated before (the floor), and `src.clone()` (a fresh allocation:
  its page faults are what every new tensor on the path pays);
- cast: the float32 embedding to bf16 (`.to`), the one cast the path needs when the tower is float32;
- encode: vitserve.rpc.wire.encode_embedding_message (frames: zero-copy views, the header only);
- zmq / zmq+curve: the frames from a DEALER to a ROUTER on TCP loopback in this process, and the reply back,
  without and with CURVE (vitserve/rpc/wirekey.py): send, encryption, the loopback, decryption, the receive;
  their difference over the bytes is CURVE's cost per GB;
- file write: the connector's vitserve.connector.files.TensorDir.write (DeepStack levels side by side, in chunks);
- read_entry: the worker's vitserve.connector.files.read_entry (one read(2) into a tensor of its own; the bench
  drops each tensor, so from the second on it reads into a reused buffer whose pages are there);
- wire / wire+curve: the whole of today's path, a real LLMSender to a real EmbeddingStore (encode done ->
  acknowledged -> read_entry done: in the encoder cache on a CPU); wire+tag: the same keyed with
  `wire_security: tag` (vitserve/rpc/tag.py: an AES-GMAC tag per message, no encryption);
- ec_storage: vitserve's safetensors file (ec_files.write_file) + the header check + vLLM's ECExampleConnector
  load (`safetensors.torch.load_file(path)["ec_cache"].clone()`), the path the cross-host target compares with;
- same host: vitserve writes the tensor into the connector's incoming area (vitserve/handover/same_host.py;
  `same_host_write` is that write alone, with its sampled checksum), the file message names it, the connector
  checks and adopts it (vitserve/connector/handoff.py) and acknowledges, and read_entry (encode done -> in the
  encoder cache);
- same host, recycled: the same, in a steady stream: each file is written over the pages of a file the connector
  let go (vitserve/connector/pool.py), not into a fresh one (`same_host_write_recycled`: that write alone).

The directory is --dir (default /dev/shm). Each run appends its record to bench/out/handover_split.jsonl and prints
RESULTS.md's table.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from bench import harness  # noqa: E402
from vitserve.connector import keys  # noqa: E402
from vitserve.connector.allowlist import DEFAULT_ACCEPT_FROM, Allowlist  # noqa: E402
from vitserve.connector.files import TensorDir, read_entry  # noqa: E402
from vitserve.connector.pool import POOL  # noqa: E402
from vitserve.connector.store import EmbeddingStore, Shape, as_dict  # noqa: E402
from vitserve.handover.ec_files import check_file, file_path  # noqa: E402
from vitserve.handover.ec_files import write_file as write_safetensors  # noqa: E402
from vitserve.handover.same_host import SameHost, write_file  # noqa: E402
from vitserve.rpc.sender import LLMSender  # noqa: E402
from vitserve.rpc.wire import ImageEmbedding, encode_embedding_message  # noqa: E402
from vitserve.rpc.wirekey import configure_client  # noqa: E402

HIDDEN = {
    3584: 3584,
    16384: 4096,
}  # the main columns: Qwen2.5-VL-7B's; Qwen3-VL-8B's 4,096 + 3 DeepStack levels
IMAGES = {"448px": (1, 32, 32), "1080p": (1, 60, 180)}  # patch grids; 2x2 merge: 256 and 2,700 rows
SECRET = b"vitserve-bench-handover-split-0123456789"
_ids = (f"{n:064x}" for n in itertools.count(1))

_LOG = logging.getLogger("bench.handover_split")


def message(parts: list[torch.Tensor], grid: tuple[int, int, int]) -> ImageEmbedding:
    uuid = next(_ids)
    return ImageEmbedding(request_id="bench", image_index=0, num_images=1, image_id=uuid, grid_thw=grid,
                          embedding=parts[0], deepstack=parts[1:], uuid=uuid)  # fmt: skip


def ms(times: list[float]) -> tuple[float, float]:
    best, median = harness.best_median(times)
    return round(best * 1e3, 2), round(median * 1e3, 2)


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()  # warm: allocation and connection costs, not timed
    return ms(harness.timed(fn, repeats))


@contextlib.contextmanager
def zmq_pair(curve: bool) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    auth = keys.configure_server(router, SECRET) if curve else None
    if curve:
        configure_client(dealer, SECRET)
    router.bind("tcp://127.0.0.1:*")
    dealer.connect(router.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        yield dealer, router
    finally:
        dealer.close(0)
        router.close(0)
        if auth is not None:
            auth.stop()
        ctx.term()


def zmq_round(
    parts: list[torch.Tensor], grid: tuple[int, int, int], curve: bool, repeats: int
) -> tuple[float, float]:
    """Frames DEALER -> ROUTER (received whole, copy=False) and a one-frame reply back."""
    frames = encode_embedding_message(message(parts, grid))
    with zmq_pair(curve) as (dealer, router):

        def once() -> None:
            dealer.send_multipart(frames, copy=False)
            peer, *_ = router.recv_multipart(copy=False)
            router.send_multipart([peer, b"ack"])
            dealer.recv()

        return timed(once, repeats)


def wire_whole(parts: list[torch.Tensor], grid: tuple[int, int, int], root: Path, key: str | None,
               repeats: int, security: str = "curve") -> tuple[float, float]:  # fmt: skip
    """Today's path: LLMSender -> EmbeddingStore, acknowledged, then read_entry."""
    width = sum(int(p.shape[1]) for p in parts)
    accept_from = Allowlist(DEFAULT_ACCEPT_FROM, "accept_from") if security == "tag" else None
    store = EmbeddingStore("tcp://127.0.0.1:*", 4 << 30, Shape(width, 2), directory=str(root), log=_LOG,
                           key=SECRET if key else None, accept_from=accept_from)  # fmt: skip
    times = []
    with contextlib.closing(store), LLMSender(store.endpoint, key_file=key, security=security) as sender:
        assert sender.wait_reachable(30), f"no connection to the store on {store.endpoint}"
        for i in range(repeats + 1):
            m = message(parts, grid)
            t0 = time.perf_counter()
            sender.send(m, deadline=time.monotonic() + 60).wait(60)
            entry = store.get(str(m.uuid))
            assert entry is not None, "acknowledged, yet the store does not hold it"
            w = as_dict(entry)
            loaded = read_entry(w["path"], w["dtype"], w["rows"], w["width"])
            times.append(time.perf_counter() - t0)
            if i == 0:
                assert torch.equal(loaded, torch.cat(parts, dim=1)), "the store's file is not the tensor sent"
            store.unpin({str(m.uuid)}, "bench")
    return ms(times[1:])


def ec_storage(tensor: torch.Tensor, root: Path, repeats: int) -> tuple[float, float]:
    uuid = next(_ids)
    path = file_path(root, uuid)

    def once() -> None:
        write_safetensors(root, uuid, tensor, {"bench": "handover_split"})
        check_file(root, uuid, tensor.shape[0], tensor.shape[1])
        safetensors.torch.load_file(str(path))["ec_cache"].clone()

    return timed(once, repeats)


def point(image: str, width: int, root: Path, key: str, repeats: int) -> dict:
    grid = IMAGES[image]
    rows = grid[0] * grid[1] * grid[2] // 4
    f32 = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    tensor = f32.to(torch.bfloat16)
    hidden = HIDDEN[width]
    parts = [p.contiguous() for p in torch.split(tensor, [hidden] * (width // hidden), dim=1)]
    mbytes = tensor.numel() * 2 / 1e6
    out: dict = {"image": image, "width": width, "rows": rows, "mbytes": round(mbytes, 2)}
    dst = torch.empty_like(tensor)
    out["memcpy"] = timed(lambda: dst.copy_(tensor), repeats)
    out["clone"] = timed(tensor.clone, repeats)
    out["cast"] = timed(lambda: f32.to(torch.bfloat16), repeats)
    out["encode"] = timed(lambda: encode_embedding_message(message(parts, grid)), repeats)
    out["zmq"] = zmq_round(parts, grid, False, repeats)
    out["zmq_curve"] = zmq_round(parts, grid, True, repeats)
    out["curve_ms_per_gb"] = round((out["zmq_curve"][0] - out["zmq"][0]) / (mbytes / 1e3), 1)
    tdir = TensorDir(root, _LOG)
    try:
        out["file_write"] = timed(lambda: tdir.write(next(_ids), parts, rows), repeats)
        path = tdir.write("read", parts, rows)
        out["read_entry"] = timed(lambda: read_entry(str(path), "bfloat16", rows, width), repeats)
    finally:
        tdir.close()
    out["wire"] = wire_whole(parts, grid, root, None, repeats)
    out["wire_curve"] = wire_whole(parts, grid, root, key, repeats)
    out["wire_tag"] = wire_whole(parts, grid, root, key, repeats, security="tag")
    out["ec_storage"] = ec_storage(tensor, root, repeats)
    out.update(same_host(parts, grid, root, repeats))
    out.update(same_host(parts, grid, root, repeats, recycled=True))
    return out


def same_host(parts: list[torch.Tensor], grid: tuple[int, int, int], root: Path, repeats: int,
              recycled: bool = False) -> dict:  # fmt: skip
    """The same-host path: vitserve.handover.same_host.SameHost writes the file into a real EmbeddingStore's
    incoming area and sends its name over a real LLMSender; the store adopts it; then read_entry. Also its write
    alone (write_file: the cast-and-write pass and the sampled checksum).

    recycled: the store's bound holds one embedding and a half, so each arrival evicts the one before (loaded,
    spent) into the pool (vitserve/connector/pool.py) and vitserve's next write claims its file and overwrites its
    pages, as in a steady stream; the write alone gives its file back to the pool as the connector would."""
    width = sum(int(p.shape[1]) for p in parts)
    nbytes = int(parts[0].shape[0]) * width * 2
    bound = nbytes * 3 // 2 if recycled else 4 << 30
    store = EmbeddingStore("tcp://127.0.0.1:*", bound, Shape(width, 2), directory=str(root), log=_LOG,
                           dtype="bfloat16")  # fmt: skip
    whole, writes, warm = [], [], 2 if recycled else 1  # recycled: the first two writes find the pool empty
    with contextlib.closing(store), LLMSender(store.endpoint) as sender:
        assert sender.wait_reachable(30), f"no connection to the store on {store.endpoint}"
        same = SameHost(sender)
        assert same.dtype(torch.float32) == torch.bfloat16, "the connector did not say it serves bfloat16"
        assert same.local, "the same-host path is not taken"
        incoming = Path(same.info.incoming)  # type: ignore[union-attr]
        for i in range(repeats + warm):
            m = message(parts, grid)
            t0 = time.perf_counter()
            same.send(m, time.monotonic() + 60, torch.bfloat16).wait(60)
            w = as_dict(store.get(str(m.uuid)))  # type: ignore[arg-type]
            loaded = read_entry(w["path"], w["dtype"], w["rows"], w["width"])
            whole.append(time.perf_counter() - t0)
            if i == 0:
                assert torch.equal(loaded, torch.cat(parts, dim=1)), "the adopted file is not the tensor"
            store.pin(str(m.uuid), "bench")  # the request that loaded it finishes: its push's claim ends
            store.unpin({str(m.uuid)}, "bench")
            t0 = time.perf_counter()
            f = write_file(incoming, message(parts, grid), torch.bfloat16, time.time() + 60)
            writes.append(time.perf_counter() - t0)
            if recycled:  # back to the pool, as the connector gives a spent entry's file
                os.rename(incoming / f.name, incoming.parent / POOL / f"p-{next(_ids)[-32:]}")
            else:
                os.unlink(incoming / f.name)
        assert same.files == repeats + warm, "a file hand-over fell back to the bytes"
        assert same.recycled >= (repeats if recycled else 0), f"{same.recycled} writes recycled a pool file"
        assert recycled or same.recycled == 0, "a fresh write found a pool file"
    key = "_recycled" if recycled else ""
    return {f"same_host{key}": ms(whole[warm:]), f"same_host_write{key}": ms(writes[warm:])}


COLUMNS = ("memcpy", "clone", "cast", "encode", "zmq", "zmq_curve", "file_write", "read_entry", "wire",
           "wire_curve", "wire_tag", "ec_storage", "same_host_write", "same_host", "same_host_write_recycled",
           "same_host_recycled")  # fmt: skip


def table(rows: list[dict]) -> list[str]:
    """Best (median) ms per image, one row per point."""
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    out = ["| image | width | MB | " + " | ".join(cols) + " | CURVE ms/GB |", "|---" * (len(cols) + 4) + "|"]
    for r in rows:
        cells = [f"{r[c][0]:.1f} ({r[c][1]:.1f})" if c in r else "-" for c in cols]
        out.append(f"| {r['image']} | {r['width']:,} | {r['mbytes']:.1f} | " + " | ".join(cells)
                   + f" | {r['curve_ms_per_gb']:.0f} |")  # fmt: skip
    return out


def main() -> None:
    parser = harness.parser(__doc__, quick="2 repeats instead of 5")
    parser.add_argument("--dir", default="/dev/shm", help="the shared-memory directory both ends use")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    torch.set_num_threads(1)
    run = harness.begin("handover_split", args)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="vitserve-split-bench-") as tmp:
        key = os.path.join(tmp, "key")
        Path(key).write_bytes(SECRET)
        rows = [point(image, width, Path(tmp), key, repeats) for width in (3584, 16384) for image in IMAGES]
    rec = {"repeats": repeats, "dir": args.dir, "rows": rows}
    harness.finish(run, rec, args)
    print("\n".join(table(rows)))
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
