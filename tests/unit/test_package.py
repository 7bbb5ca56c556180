"""`import vitserve` is cheap; the public names load on first use (PEP 562)."""

from __future__ import annotations

import pytest

import vitserve

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
