"""The `vitserve` flags: flags + VITSERVE_* environment -> one Config, and the --help that lists them.

The flags are defined by what they are for, one module each: model_device.py (the checkpoint, device, runtime
directory), serving.py (HTTP, cache, security, logging), scaleout.py (parallelism and nodes),
encoder_budget.py (the encoder's token and memory budget), request_limits.py (what a request may carry and
how media are decoded) and handoff.py (the hand-over to an LLM server); spec.py holds `Flag` and the parsers. Each module also checks
its own flags (`validate`).

This is the only place that reads the environment for settings (docs/api.md): each flag also reads
VITSERVE_<FLAG_UPPER> (the flag wins), and torchrun's environment (MASTER_ADDR, MASTER_PORT, GROUP_RANK,
WORLD_SIZE, ...: preflight.torchrun_values) fills the node flags no flag set. `build_config` validates what
a flag alone can tell (ranges, names, URL shapes) and raises ConfigError naming the flag; vitserve/cli.py
turns that into exit 2 and one line.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

import vitserve
from vitserve import preflight
from vitserve.config import Config
from vitserve.errors import ConfigError
from vitserve.flags import encoder_budget, handoff, model_device, request_limits, scaleout, serving
from vitserve.flags.spec import Flag, parse_int, parse_size

GROUPS = (
    "model",
    "server",
    "parallelism",
    "budget and limits",
    "LLM handoff",
    "cache",
    "security",
    "logging",
    "runtime",
)
# The one table of flags, in --help's order. Defaults come from Config, so there is one source of truth for
# them too.
FLAGS: dict[str, Flag] = {
    **model_device.MODEL,
    **serving.SERVER,
    **scaleout.PARALLELISM,
    **encoder_budget.BUDGET,
    **request_limits.MEDIA,
    **handoff.HANDOFF,
    **serving.CACHE,
    **serving.SECURITY,
    **serving.LOGGING,
    **model_device.RUNTIME,
}
_DEFAULTS: dict[str, Any] = {
    f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    for f in dataclasses.fields(Config)
}
_UNITS = {"_s": " s", "_gb": " GiB"}


def env_name(flag: str) -> str:
    return "VITSERVE_" + flag.upper()


def _size_text(n: int) -> str:
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def default_text(flag: str) -> str:
    """The default as --help shows it: '64 MiB', 'none', 'on'/'off', '120 s', '50,000,000'."""
    spec, value = FLAGS[flag], _DEFAULTS[flag]
    if spec.default_text is not None:
        return spec.default_text
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(value)
    if spec.parse is parse_size:
        return _size_text(value)
    if isinstance(value, float):
        return f"{value:g}" + next((u for end, u in _UNITS.items() if flag.endswith(end)), "")
    if isinstance(value, int) and value >= 1_000_000:
        return f"{value:,}"
    return str(value)


def _metavar(flag: str) -> str:
    spec = FLAGS[flag]
    if spec.parse is parse_size:
        return "SIZE"
    if spec.parse is parse_int or flag.endswith("_tokens"):
        return "N"
    if flag.endswith("_s"):
        return "SECONDS"
    if flag.endswith("_gb"):
        return "GIB"
    return flag.rsplit("_", 1)[-1].upper()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vitserve",
        description="Serve the vision encoder of a multimodal LLM.",
        epilog="Every flag also reads the environment variable shown with it (the flag wins); "
        "--flag_name and --flag-name are the same flag.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--version", action="version", version=f"vitserve {vitserve.__version__}")
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for flag, spec in FLAGS.items():
        full_help = f"{spec.help} [default: {default_text(flag)}; env {env_name(flag)}]"
        names = [(flag, full_help)] + ([(flag.replace("_", "-"), argparse.SUPPRESS)] if "_" in flag else [])
        for name, help_text in names:  # the hyphenated alias works but is not listed a second time
            if isinstance(_DEFAULTS[flag], bool):  # switches: --flag / --no-flag
                groups[spec.group].add_argument(
                    f"--{name}", dest=flag, action=argparse.BooleanOptionalAction, help=help_text
                )
            else:
                groups[spec.group].add_argument(
                    f"--{name}", dest=flag, metavar=_metavar(flag), type=str, help=help_text
                )
    return p


def _convert(flag: str, raw: str | bool, source: str) -> object:
    if isinstance(raw, bool):
        return raw
    try:
        return FLAGS[flag].parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def build_config(argv: list[str] | None, environ: Mapping[str, str]) -> Config:
    """Flags, then VITSERVE_* env, then Config defaults. Raises ConfigError naming the knob."""
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}  # one type per flag (int, float, str, bool, tuple)
    for flag in FLAGS:
        if flag in args:
            values[flag] = _convert(flag, args[flag], f"--{flag}")
        elif env_name(flag) in environ:
            values[flag] = _convert(flag, environ[env_name(flag)], env_name(flag))
    for flag, value in preflight.torchrun_values(environ).items():
        values.setdefault(flag, value)
    config = Config(**values, **encoder_budget.budget_source(values))
    validate(config)
    return config


def validate(config: Config) -> None:
    """Each group's checks of what a flag alone can tell; the first failure raises ConfigError."""
    for group in (scaleout, encoder_budget, request_limits, model_device, handoff, serving):
        group.validate(config)
