"""`import vitserve` is cheap; the public names load on first use (PEP 562)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import vitserve
from tests.cli import Cli

HEAVY = ("torch", "zmq", "transformers")


def test_public_names_import_from_the_package():
    from vitserve import AsyncVitserveClient, EmbeddingReceiver, VitserveClient, VitserveClientError
    from vitserve.client import AsyncVitserveClient as DefinedAsync
    from vitserve.client import VitserveClient as Defined
    from vitserve.rpc.receiver import EmbeddingReceiver as DefinedReceiver

    assert (VitserveClient, AsyncVitserveClient, EmbeddingReceiver) == (
        Defined,
        DefinedAsync,
        DefinedReceiver,
    )
    assert issubclass(VitserveClientError, Exception)
    assert set(vitserve.__all__) <= set(dir(vitserve))


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = vitserve.NoSuchThing


def _loaded_after(code: str) -> dict:
    probe = f"import json, sys; {code}; print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout)


def test_import_vitserve_loads_no_heavy_dependency():
    assert _loaded_after("import vitserve; vitserve.__version__") == dict.fromkeys(HEAVY, False)


def test_the_lazy_names_do_load_their_modules():
    """The check above could pass by never loading anything; here the same probe sees torch and zmq."""
    loaded = _loaded_after("from vitserve import VitserveClient, EmbeddingReceiver")
    assert loaded["torch"]
    assert loaded["zmq"]


def test_version_flag_needs_no_heavy_dependency(tmp_path):
    assert _loaded_after("import vitserve.cli") == dict.fromkeys(HEAVY, False)
    out = Cli.run(["--version"], tmp_path)
    assert (out.returncode, out.stdout.strip()) == (0, f"vitserve {vitserve.__version__}")


@pytest.mark.parametrize("module", ["vitserve.video.decoder_pool", "vitserve.processors.pixels"])
def test_a_decoder_process_imports_no_transformers(module):
    """The video decoder processes (spawned) import these two; the package `__init__`s load their names
    lazily, so transformers (~10 s of a decoder's start on 2 cores) is not imported through them."""
    assert not _loaded_after(f"import {module}")["transformers"]


def test_the_video_processor_does_load_transformers():
    """The check above could pass by never loading anything: the lazy name that needs it loads it."""
    assert _loaded_after("from vitserve.video import load_video_processor")["transformers"]


@pytest.mark.parametrize("package", ["vitserve.video", "vitserve.processors"])
def test_the_packages_lazy_names_are_the_defined_ones(package):
    import importlib

    module = importlib.import_module(package)
    assert set(module.__all__) <= set(dir(module))
    for public in module.__all__:
        defined = getattr(module, public)
        assert defined.__name__ == public
        assert defined.__module__.startswith(package + ".")
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = module.NoSuchThing
