"""What one flag is (`Flag`: its parser, --help group and help) and the parsers the flag tables share.

A parser turns the text of a flag or of its VITSERVE_* variable into the Config field's value, or raises
ValueError (vitserve/flags/__init__.py turns that into ConfigError naming the flag).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from vitserve.config import Config
from vitserve.errors import ConfigError

T = TypeVar("T")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


class Flag(NamedTuple):
    parse: Callable[[str], Any]  # text (flag or env) -> value
    group: str  # the --help section it is listed under
    help: str
    default_text: str | None = None  # when the Config default alone would not say what happens


def parse_size(text: str) -> int:
    """Bytes from '67108864', '64MiB', '64M', '1.5GB' (K/M/G/T are powers of 1024 either way)."""
    m = _SIZE.match(text.replace("_", "").replace(",", ""))
    if not m:
        raise ValueError(f"not a size: {text!r}")
    scale = 1024 ** "_kmgt".index(m.group(2).lower() or "_")
    return int(float(m.group(1)) * scale)


def parse_int(text: str) -> int:
    return int(text.replace(",", "").replace("_", ""))


def parse_bool(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_domains(text: str) -> tuple[str, ...]:
    return tuple(d.strip().lower() for d in text.split(",") if d.strip())


def optional(convert: Callable[[str], T]) -> Callable[[str], T | None]:
    """'' or 'none' -> None, anything else through ``convert``."""
    return lambda text: None if text.strip().lower() in ("", "none") else convert(text)


def check_positive(config: Config, *flags: str, allow_zero: bool = False) -> None:
    """Each named Config field, when set, is > 0 (>= 0 with ``allow_zero``), or ConfigError naming its flag."""
    for flag in flags:
        value = getattr(config, flag)
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise ConfigError(f"--{flag} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
