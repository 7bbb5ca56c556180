"""The interface every transport implements: how a chat request's embeddings reach the LLM server.

The front door (api/chat.py) picks one `Transport` at start-up, from handover/transports.py's table keyed by
--llm_transport, and for each chat request with image or video parts calls its `Handover`'s steps in order:

1. `held(digests)` (only when `reuses`): per image, by its bytes' sha256, whether the LLM side still holds its
   embedding; those images are neither decoded nor encoded (ec_storage: its file is still there).
2. `reused_part(index)`, `image_part(...)`, `video_part(...)`: the part that replaces each `image_url` and
   `video_url` part, checked against what the LLM will assume (on the preprocessing pool: a transport may
   write or start sending here).
3. `ready(payload)`: just before sending, the transport's own checks and request fields (ec_storage: fields
   stripped, files still there; a transport that pushes tensors awaits their acknowledgements here), then the
   body that goes upstream, with `upstream_headers()`. A VitserveError raised here means nothing goes
   upstream.
4. `check_answer(status, content)`: the LLM server's answer read as this transport's (ec_storage: a
   non-consumer's 400 becomes a 502).
5. `release()`: after the answer (a stream: once relayed); may be called more than once.

A request without media parts uses `NO_MEDIA`: its body goes upstream as it came, and its answer unread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from vitserve.config import Config
from vitserve.contract import ItemResult, PreparedImage, PreparedVideo
from vitserve.handover.embeds import EmbedsLayout
from vitserve.handover.inline_body import dumps_body
from vitserve.metrics import Metrics
from vitserve.transport_specs import TransportSpec

# A CPU-heavy call on the preprocessing pool, awaited (api/preprocess.py Preprocessor.run).
Run = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Setup:
    """What the front door gives a transport when it is built, once per app."""

    config: Config
    layout: EmbedsLayout  # what the LLM server assumes of an embedding (rows, width, time)
    metrics: Metrics
    run: Run  # the preprocessing pool
    fingerprint: Callable[[], str]  # the engine's, known once it is ready (before any chat request)


class Handover:
    """One chat request's hand-over (the steps in the module docstring). This base is `NO_MEDIA`'s: nothing
    is held, and the answer is the LLM server's own."""

    reuses: ClassVar[bool] = False  # True: `held` is asked before anything is decoded

    async def held(self, digests: list[str]) -> list[bool]:
        """Per image (its bytes' sha256, in request order): True when it needs no encoding."""
        return [False] * len(digests)

    def reused_part(self, index: int) -> dict[str, Any] | None:
        """The part for image `index` when `held` said it needs no encoding, else None."""
        return None

    def image_part(self, image: PreparedImage, result: ItemResult, index: int) -> dict[str, Any]:
        """The part that replaces image `index`'s `image_url` part, checked (EmbeddingMismatch)."""
        raise NotImplementedError(f"{type(self).__name__} hands over no images")

    def video_part(self, video: PreparedVideo, results: list[ItemResult], index: int) -> dict[str, Any]:
        """The part that replaces video `index`'s `video_url` part, checked."""
        raise NotImplementedError(f"{type(self).__name__} hands over no videos")

    async def ready(self, payload: dict[str, Any]) -> bytes:
        """The body to send, once the transport's last checks pass."""
        raise NotImplementedError(f"{type(self).__name__} builds no body")

    def upstream_headers(self) -> dict[str, str]:
        """Headers the request goes upstream with besides the client's (wire with --llm_dp_size: the engine
        core that holds its embeddings)."""
        return {}

    def check_answer(self, status: int, content: bytes) -> None:
        """Raise the VitserveError an answer means for this transport; None: relay it unchanged."""
        return

    def release(self) -> None:
        """What the request held, let go (idempotent)."""
        return


NO_MEDIA = Handover()


class Transport(TransportSpec):
    """One way of handing embeddings to the LLM server, built once per app from its `Setup`. Each extends its
    transport's start-up facts (vitserve/transport_specs.py: its --llm_transport name, flag checks, preflight,
    banner line), so one class answers for the transport from the flags to /ready."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.layout = setup.layout

    def begin(self) -> Handover:
        """A new request's hand-over."""
        raise NotImplementedError

    async def body(self, payload: dict[str, Any]) -> bytes:
        """The payload as the upstream body (compact JSON, inline tensors spliced in), on the pool."""
        return await self.setup.run(dumps_body, payload)  # type: ignore[no-any-return]

    def readiness(self) -> str | None:
        """Why /ready answers 503 for this transport (wire: no connector connected); None: no reason."""
        return None

    async def close(self) -> None:
        """Release what the transport holds for the app's lifetime (sockets, threads)."""
        return
