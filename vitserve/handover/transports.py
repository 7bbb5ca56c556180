"""The transports, by their --llm_transport value: the front door builds the one named, once per app.

Adding a transport is its start-up facts in vitserve/transport_specs.py (a `TransportSpec` and its line in
`SPECS`), one module in this package (a `Transport` that extends that spec, and its `Handover`,
handover/base.py) and one line here; tests/unit/test_transport_names.py checks the two tables agree.
"""

from __future__ import annotations

from vitserve.handover.base import Setup, Transport
from vitserve.handover.ec_storage import EcStorageTransport
from vitserve.handover.inline import InlineTransport
from vitserve.handover.pull import PullTransport
from vitserve.handover.wire import WireTransport

TRANSPORTS: dict[str, type[Transport]] = {
    InlineTransport.name: InlineTransport,
    EcStorageTransport.name: EcStorageTransport,
    WireTransport.name: WireTransport,
    PullTransport.name: PullTransport,
}


def open_transport(setup: Setup) -> Transport:
    """The transport --llm_transport names, built (ec_storage takes over an earlier run's files now)."""
    return TRANSPORTS[setup.config.llm_transport](setup)
