"""The transports, by their --llm_transport value: the front door builds the one named, once per app.

Adding a transport is one module in this package (a `Transport` and its `Handover`, handover/base.py) and
one line here.
"""

from __future__ import annotations

from vitserve.handover.base import Setup, Transport
from vitserve.handover.ec_storage import EcStorageTransport
from vitserve.handover.inline import InlineTransport

TRANSPORTS: dict[str, type[Transport]] = {
    InlineTransport.name: InlineTransport,
    EcStorageTransport.name: EcStorageTransport,
}


def open_transport(setup: Setup) -> Transport:
    """The transport --llm_transport names, built (ec_storage takes over an earlier run's files now)."""
    return TRANSPORTS[setup.config.llm_transport](setup)
