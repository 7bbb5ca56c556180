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
