"""The shapes bench/gpu_check_parts.py and bench/gpu_check_speed.py both measure, and how a speed row reads:
sizes in merged units (w, h), so one list serves a patch-14 tower (x 28 px) and a patch-16 one (x 32 px); a
batch filled under a budget; the matmul FLOPs of one forward (for MFU); the printed speed line. Both parts
import this module, never each other."""

from __future__ import annotations

from typing import Any

import torch

from bench.encoder import matmul_flops

MIXED_UNITS = [(8, 8), (16, 12), (23, 17), (12, 24), (29, 19), (10, 10)]  # bench/gpu.py's MIXED at 28 px


def px(units: list[tuple[int, int]], patch: int) -> list[tuple[int, int]]:
    return [(w * 2 * patch, h * 2 * patch) for w, h in units]


def units_448(patch: int) -> tuple[int, int]:
    side = 448 // (2 * patch)  # 16 at patch 14, 14 at patch 16
    return (side, side)


def fill(budget: int, pool: list[tuple[int, int]], max_images: int) -> list[tuple[int, int]]:
    """Units cycled from `pool` while the merged tokens stay within `budget` and the images within the cap."""
    out: list[tuple[int, int]] = []
    used = 0
    while len(out) < max_images:
        w, h = pool[len(out) % len(pool)]
        if used + w * h > budget:
            break
        out.append((w, h))
        used += w * h
    return out


def flops(grid: torch.Tensor, vision: dict[str, Any], model_type: str) -> float:
    """Matmul FLOPs of one forward (2 per multiply-add); bench/encoder.py's formula for Qwen2.5-VL."""
    if model_type == "qwen2_5_vl":
        return matmul_flops(grid, vision)
    e, i, out, depth = (
        vision["hidden_size"],
        vision["intermediate_size"],
        vision["out_hidden_size"],
        vision["depth"],
    )
    sizes = grid.prod(-1).tolist()
    n = sum(sizes)
    blocks = depth * (2 * n * (4 * e * e + 2 * e * i) + sum(4 * s * s * e for s in sizes))
    patch_embed = 2 * n * (3 * 2 * vision["patch_size"] ** 2) * e
    mergers = (1 + len(vision.get("deepstack_visual_indexes", []))) * 2 * (n // 4) * (4 * e) * (4 * e + out)
    return float(blocks + patch_embed + mergers)


def speed_line(row: dict[str, Any]) -> str:
    ips, mfu = row["images_per_s"], row["mfu"]
    return ", ".join(f"{m} {ips[m]:.1f} img/s (MFU {100 * mfu.get(m, 0):.1f}%)" for m in row["seconds"]) + (
        f", x{row['x_hf_packed']:.2f} HF packed" if "x_hf_packed" in row else ""
    )
