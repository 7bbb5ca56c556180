"""Refuse, before any rank is spawned, a configuration that can never serve (docs/api.md, exit code 2).

`check(config)` opens the checkpoint (vitserve/checkpoint.py: its JSON files, no torch, no transformers),
so it answers in well under a second, and returns it for the rest of start-up. `check_budget` takes the image
processor's clamp_info, the one place that knows a family's smallest image. Each refusal is one ConfigError
that names the flag and a value that would work. These move the failures that are certain in front of every
slow step; the TP check (`check_tp`) is the only one there is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from functools import reduce
from pathlib import Path
from typing import Any

from vitserve.checkpoint import Checkpoint
from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.families import FAMILIES, Family, tokens_per_tile
from vitserve.transport_specs import spec_of

log = logging.getLogger(__name__)
IPC_PATH_MAX = 107  # bytes in a Unix socket path (sun_path is 108 with the terminating NUL)


def check(config: Config) -> Checkpoint:
    """Every refusal that needs only the flags and the checkpoint's JSON files; the opened checkpoint."""
    check_nodes(config)
    if config.llm_endpoint is not None:
        check_llm_endpoint(config.llm_endpoint)
    checkpoint = Checkpoint.open(config.model, config.model_family)
    checkpoint.check_servable()
    check_tp(config.tp, checkpoint.family, checkpoint.vision)
    if config.cuda_graphs:
        check_cuda_graphs(config, checkpoint.family)
    if config.llm_url is not None:
        llm_embeds_width(checkpoint)
    spec_of(config).preflight(config, checkpoint.family)  # the transport's own (transport_specs.py)
    smallest = smallest_image(checkpoint)
    if smallest is not None:
        check_budget(config.visual_batch_max_tokens, checkpoint.family, *smallest)
    return checkpoint


def check_cuda_graphs(config: Config, family: Family) -> None:
    """--cuda_graphs needs what can be captured: CUDA, half precision, one rank, a Qwen tower."""
    why = None
    if config.device == "cpu":
        why = "--device cpu"
    elif config.dtype in ("float32", "fp32"):
        why = f"--dtype {config.dtype} (no varlen attention kernel in float32)"
    elif config.tp > 1:
        why = f"--tp {config.tp} (the all-reduce is not captured)"
    elif family.layout == "tiles":
        why = f"the {family.name} tower (only Qwen towers are captured)"
    if why is not None:
        raise ConfigError(f"--cuda_graphs does not work with {why}; drop --cuda_graphs")


def llm_embeds_width(checkpoint: Checkpoint) -> int:
    """The width of the embedding rows the LLM server assumes for --model (the front door checks every
    embedding against it, docs/vllm.md); refused when the checkpoint names no language model."""
    width = checkpoint.llm_embeds_width
    if width is None:
        raise ConfigError(
            f"--llm_url needs the checkpoint the LLM server serves: --model {checkpoint.name} has no language "
            "model (its config.json names no text_config.hidden_size, which every embedding sent to the LLM "
            "server must match); give --model /path/to/checkpoint"
        )
    return width


# ------------------------------------------------------------------------------------------------ --tp


def shard_sizes(family: Family, vision: Mapping[str, Any]) -> dict[str, int]:
    """What --tp must divide, by name, from the vision config (keys it lacks are left to the ranks): attention
    heads (q, k and v are split by head), the width (the attention output projection's input) and the MLP
    width (column- then row-parallel), where the family's registry entry says they are. Mergers and projectors
    are replicated, not split."""
    heads, width = vision.get(family.heads_key), vision.get(family.width_key)
    mlp = vision.get("intermediate_size")
    if family.mlp_from_ratio and width is not None:
        mlp = int(width * vision.get("mlp_ratio", 4))  # Qwen2-VL's MLP: int(embed_dim * mlp_ratio)
    named = {"vision attention heads": heads, "vision width": width, "MLP width": mlp}
    return {what: int(v) for what, v in named.items() if isinstance(v, (int, float)) and v > 0}


def allowed_tp(sizes: Mapping[str, int]) -> list[int]:
    """Every --tp that divides all of `sizes`."""
    common = reduce(math.gcd, sizes.values(), 0)
    return [d for d in range(1, common + 1) if common % d == 0] if common else []


def check_tp(tp: int, family: Family, vision: Mapping[str, Any]) -> None:
    """The one --tp check (vitserve/model/tp.py's pass assumes it passed): every size it splits divides."""
    sizes = shard_sizes(family, vision)
    for what, value in sizes.items():
        if value % tp:
            raise ConfigError(
                f"--tp {tp} does not divide the {family.display} {what} ({value}); "
                f"use --tp {_or_list(allowed_tp(sizes))}"
            )


def _or_list(values: list[int]) -> str:
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


# ------------------------------------------------------------------------------------------------ nodes


def torchrun_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config values from torchrun's environment, for the node flags that no flag or VITSERVE_* variable set:
    MASTER_ADDR, MASTER_PORT, and under torchrun (GROUP_RANK set) the node count and this node's rank.
    torchrun starts --nproc_per_node copies of vitserve per node, and vitserve spawns its own ranks, so
    only --nproc_per_node 1 fits; NODE_RANK (launch scripts' name) stands for GROUP_RANK."""

    def number(name: str) -> int:
        try:
            return int(environ[name])
        except ValueError:
            raise ConfigError(f"{name}={environ[name]!r} in the environment is not an integer") from None

    values: dict[str, Any] = {}
    if environ.get("MASTER_ADDR"):
        values["master_addr"] = environ["MASTER_ADDR"]
    if environ.get("MASTER_PORT"):
        values["master_port"] = number("MASTER_PORT")
    rank_var = next((v for v in ("GROUP_RANK", "NODE_RANK") if environ.get(v)), None)
    if rank_var is not None:
        values["node_rank"] = number(rank_var)
    if environ.get("LOCAL_WORLD_SIZE") and number("LOCAL_WORLD_SIZE") != 1:
        raise ConfigError(
            f"torchrun started {environ['LOCAL_WORLD_SIZE']} copies of vitserve on this node "
            "(--nproc_per_node); vitserve spawns its own --tp / --nnodes ranks: use torchrun --nproc_per_node 1"
        )
    if environ.get("GROUP_WORLD_SIZE"):
        values["nnodes"] = number("GROUP_WORLD_SIZE")
    elif environ.get("WORLD_SIZE") and rank_var is not None:
        values["nnodes"] = number("WORLD_SIZE")  # one process per node (LOCAL_WORLD_SIZE 1)
    return values


def check_nodes(config: Config) -> None:
    """--nnodes / --node_rank / --master_*: one TP group of --tp ranks, --tp / --nnodes on each node."""
    nnodes, rank, tp = config.nnodes, config.node_rank, config.tp
    if not 0 <= rank < nnodes:
        raise ConfigError(f"--node_rank {rank} is not a node of --nnodes {nnodes}; use 0..{nnodes - 1}")
    port = config.master_port
    if port is not None and not 0 < port + config.dp - 1 <= 65535:
        raise ConfigError(f"--master_port {port} (+ --dp - 1) must be 1..65535")
    if nnodes == 1:
        return
    if tp % nnodes:
        raise ConfigError(
            f"--tp {tp} cannot be split over --nnodes {nnodes}: each node runs --tp / --nnodes ranks of the "
            f"group; use --tp {nnodes}, {2 * nnodes} or another multiple of {nnodes}"
        )
    if config.dp > 1:
        raise ConfigError(
            f"--dp {config.dp} with --nnodes {nnodes}: one TP group spans the nodes; use --dp 1, or run "
            "one vitserve per node as replicas (docs/engine.md, Nodes)"
        )
    if not config.master_addr:
        raise ConfigError(
            f"--nnodes {nnodes} needs --master_addr: node 0's address, which every node can reach "
            "(torchrun's MASTER_ADDR)"
        )


# ------------------------------------------------------------------------------------------------ budget


def smallest_image(checkpoint: Checkpoint) -> tuple[int, str] | None:
    """(tokens, what) of the smallest image the family's processor produces: Qwen grows every image to at
    least min_pixels, InternVL's smallest image is one tile. The same sources, in the same order, as
    vitserve/processors/hf_config.py; None when a value only HF's class defaults would give is missing
    (the loaded processor's clamp_info is then checked by check_processor_budget)."""
    family, geometry, processor = checkpoint.family, checkpoint.geometry, checkpoint.processor_config
    if family.layout == "tiles":
        tile = geometry.tile_size
        if processor is not None:
            size = processor.get("size")
            if not isinstance(size, dict) or "height" not in size:
                return None
            tile = int(size["height"])
        per_tile = tokens_per_tile(tile, geometry.patch_size, geometry.downsample_ratio)
        return per_tile, f"one {tile}-pixel tile"
    found: tuple[Any, Any, Any] = (family.min_pixels, geometry.patch_size, geometry.merge_size)
    if processor is not None:
        size = processor.get("size")
        shortest = size.get("shortest_edge") if isinstance(size, dict) else None
        found = (
            processor.get("min_pixels", shortest),
            processor.get("patch_size"),
            processor.get("merge_size"),
        )
        if None in found:
            return None
    min_pixels, factor = int(found[0]), int(found[1]) * int(found[2])
    return max(1, -(-min_pixels // (factor * factor))), f"min_pixels {min_pixels}"


def check_budget(budget_tokens: int, family: Family, minimum: int, what: str) -> None:
    """A budget below the family's smallest image would refuse images with 413 (every image, for tiles)."""
    if 0 < budget_tokens < minimum:
        raise ConfigError(
            f"--visual_batch_max_tokens {budget_tokens} is below the smallest {family.display} image "
            f"({what}: {minimum} tokens); use --visual_batch_max_tokens {minimum} or more"
        )


def check_processor_budget(budget_tokens: int, clamp_info: Mapping[str, Any]) -> None:
    """check_budget from a loaded image processor's clamp_info: the backstop for what smallest_image could
    not tell from the JSON files."""
    tiles = "tokens_per_tile" in clamp_info
    minimum = int(clamp_info["tokens_per_tile"] if tiles else clamp_info.get("min_tokens") or 0)
    what = "one tile" if tiles else f"min_pixels {clamp_info.get('min_pixels')}"
    check_budget(budget_tokens, FAMILIES[clamp_info["family"]], minimum, what)


# ------------------------------------------------------------------------------------------------ ipc


def check_llm_endpoint(endpoint: str) -> None:
    """An ipc:// endpoint's directory is created (0700) when missing: the LLM server binds the socket there,
    and in a pod the two containers may start in either order. Refused: a path too long for a Unix socket,
    or a directory that cannot be made."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint.removeprefix("ipc://"))
    if len(str(path).encode()) > IPC_PATH_MAX:
        raise ConfigError(
            f"--llm_endpoint {endpoint!r}: the socket path is {len(str(path).encode())} bytes, above the "
            f"{IPC_PATH_MAX}-byte limit of Unix sockets; use a shorter path such as ipc:///run/vitserve/llm.sock"
        )
    directory = path.parent
    if directory.is_dir():
        return
    try:
        directory.mkdir(mode=0o700, parents=True)
    except OSError as exc:
        raise ConfigError(
            f"--llm_endpoint {endpoint!r}: cannot create its directory {directory} ({exc.strerror or exc}); "
            "create it, or use a path in a writable directory"
        ) from None
    log.info("created %s (mode 0700) for --llm_endpoint %s", directory, endpoint)
