"""e2e fixtures: a real uvicorn server on an ephemeral 127.0.0.1 port, driven over real HTTP."""

from __future__ import annotations

import sys

USING_STANDINS = False
try:  # proc's modules; stand-ins only until they are on main (see _standins.py)
    import vitserve.images  # noqa: F401
    import vitserve.processors  # noqa: F401
    from vitserve.processors import load_image_processor  # noqa: F401
except ImportError:
    from tests.e2e import _standins

    USING_STANDINS = True
    sys.modules["vitserve.images"] = _standins.as_module(
        "vitserve.images", decode_image=_standins.decode_image, DecodedImage=_standins.DecodedImage)
    sys.modules["vitserve.processors"] = _standins.as_module(
        "vitserve.processors", load_image_processor=_standins.load_image_processor)
