"""The libtiff that Pillow decodes TIFFs with: which codecs it has, and its messages routed to logging.

Pillow offers no hook for either. libtiff prints warnings and errors ("Unknown field with tag ...", "WEBP
compression support is not configured.") straight to stderr, i.e. into the server log, from whichever
decode thread hit them. Redirecting fd 2 around a decode would be process-wide and race with every other
thread, so instead this module installs libtiff's own global handlers once (``TIFFSetWarningHandler`` /
``TIFFSetErrorHandler``, documented libtiff API) through ctypes: each message goes to the
``vitserve.libtiff`` logger at DEBUG level. The handlers only format and log, so any thread may call them;
ctypes takes the GIL for the callback.

The library is found among the shared objects this process already mapped (Pillow's ``_imaging`` links it),
so ``ctypes.CDLL`` returns the very copy Pillow uses. Where that fails (not Linux, a Pillow without libtiff),
nothing is installed and ``codec_configured`` answers None: decoding works as before, only noisier.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import PIL.Image  # noqa: F401  (loads _imaging, hence libtiff, before we look for it)

log = logging.getLogger("vitserve.libtiff")

# void handler(const char *module, const char *fmt, va_list ap); va_list travels as a pointer on x86-64/arm64
_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p)
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "lib": CDLL | None, "vsnprintf", the installed handlers (kept alive)


def _find_libtiff() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libtiff" in line and ".so" in line})
    except OSError:
        return None
    for path in paths:
        if os.path.basename(path).startswith("libtiff"):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _format(fmt: bytes | None, ap: int | None) -> str:
    if not fmt:
        return ""
    buf = ctypes.create_string_buffer(512)
    try:
        _state["vsnprintf"](buf, len(buf), fmt, ap)
        return buf.value.decode("utf-8", "replace")
    except Exception:  # formatting is best effort; the template alone still says what happened
        return fmt.decode("utf-8", "replace")


def _make_handler(level_name: str) -> Any:  # a ctypes CFUNCTYPE instance, which has no static type
    def handler(module: bytes | None, fmt: bytes | None, ap: int | None) -> None:
        if log.isEnabledFor(logging.DEBUG):
            name = module.decode("utf-8", "replace") if module else "libtiff"
            log.debug("libtiff %s: %s: %s", level_name, name, _format(fmt, ap))

    return _HANDLER(handler)


def _load() -> ctypes.CDLL | None:
    """Find libtiff and install the handlers, once per process."""
    with _lock:
        if "lib" in _state:
            lib_seen: ctypes.CDLL | None = _state["lib"]
            return lib_seen
        lib = _find_libtiff()
        _state["lib"] = lib
        if lib is None:
            return None
        libc = ctypes.CDLL(None)
        libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
        _state["vsnprintf"] = libc.vsnprintf
        _state["handlers"] = (
            _make_handler("warning"),
            _make_handler("error"),
        )  # kept alive: libtiff holds them
        for setter, handler in zip(
            ("TIFFSetWarningHandler", "TIFFSetErrorHandler"), _state["handlers"], strict=True
        ):
            fn = getattr(lib, setter)
            fn.argtypes, fn.restype = [_HANDLER], ctypes.c_void_p
            fn(handler)
        lib.TIFFIsCODECConfigured.argtypes = [ctypes.c_uint16]
        lib.TIFFIsCODECConfigured.restype = ctypes.c_int
        return lib


def install_log_handlers() -> bool:
    """Route libtiff's messages to logging (idempotent); False when libtiff could not be found."""
    return _load() is not None


def codec_configured(compression: int) -> bool | None:
    """Whether this libtiff can decode TIFF compression scheme ``compression``; None when unknown."""
    lib = _load()
    if lib is None or not 0 <= compression <= 0xFFFF:
        return None if lib is None else False
    return bool(lib.TIFFIsCODECConfigured(compression))
