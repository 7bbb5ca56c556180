"""HTTP client for vitserve's /encode (docs/api.md), sync and asyncio.

    from vitserve import VitserveClient
    with VitserveClient("http://127.0.0.1:8100") as c:
        if c.ready():
            out = c.encode(["cat.jpg", open("dog.png", "rb").read(), pil_image], return_embeddings=True)
            out["images"][0]["embedding"]        # torch.Tensor (num_tokens, dim)

ready() and health() are probes: they answer False when the server cannot be reached (refused, DNS
failure, timeout) instead of raising. encode() and info() raise VitserveClientError for every failure.
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import httpx
import torch

from vitserve.rpc.tensors import tensor_from_buffer

ImageLike = Any  # str | os.PathLike | bytes | PIL.Image.Image


class VitserveClientError(Exception):
    """An error answer from vitserve (or a transport failure: status 0, code 'connection_error')."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        image_index: int | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.image_index = image_index
        self.retry_after_s = retry_after_s


def image_bytes(image: ImageLike) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return f.read()
    if hasattr(image, "save"):  # PIL.Image: sent losslessly as PNG
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"cannot send {type(image).__name__} as an image; give a path, bytes or a PIL.Image")


def _files(
    images: list[ImageLike], request_id: str | None, return_embeddings: bool
) -> tuple[list[tuple[str, tuple[str, bytes, str]]], dict[str, str]]:
    files = [
        ("images", (f"image{i}", image_bytes(img), "application/octet-stream"))
        for i, img in enumerate(images)
    ]
    data = {"return_embeddings": "true" if return_embeddings else "false"}
    if request_id is not None:
        data["request_id"] = request_id
    return files, data


def _decode_tensor(t: dict[str, Any]) -> torch.Tensor:
    return tensor_from_buffer(base64.b64decode(t["b64"]), t["dtype"], t["shape"])


def _result(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code != 200:
        try:
            err = resp.json()["error"]
            code, message, index = err["code"], err["message"], err.get("image_index")
        except (ValueError, KeyError, TypeError):
            code, message, index = "http_error", resp.text[:500], None
        retry = resp.headers.get("retry-after")
        raise VitserveClientError(
            resp.status_code,
            code,
            message,
            image_index=index,
            retry_after_s=float(retry) if retry and retry.isdigit() else None,
        )
    body: dict[str, Any] = resp.json()
    for img in body.get("images", []):
        if "embedding" in img:
            img["embedding"] = _decode_tensor(img["embedding"])
        if "deepstack" in img:
            img["deepstack"] = [_decode_tensor(t) for t in img["deepstack"]]
    return body


def _connection_error(exc: httpx.HTTPError) -> VitserveClientError:
    return VitserveClientError(0, "connection_error", f"{type(exc).__name__}: {exc}")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class VitserveClient:
    def __init__(
        self, base_url: str = "http://127.0.0.1:8100", api_key: str | None = None, timeout: float = 300.0
    ):
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, trust_env=False
        )

    def encode(
        self, images: list[ImageLike], return_embeddings: bool = False, request_id: str | None = None
    ) -> dict[str, Any]:
        files, data = _files(images, request_id, return_embeddings)
        try:
            resp = self._http.post("/encode", files=files, data=data)
        except httpx.HTTPError as exc:
            raise _connection_error(exc) from exc
        return _result(resp)

    def info(self) -> dict[str, Any]:
        try:
            return _result(self._http.get("/v1/info"))
        except httpx.HTTPError as exc:
            raise _connection_error(exc) from exc

    def ready(self) -> bool:
        """True when the encoder accepts work (/ready is 200); False when not, or when unreachable."""
        return self._probe("/ready")

    def health(self) -> bool:
        """True when the HTTP server answers /health; False when unreachable."""
        return self._probe("/health")

    def _probe(self, path: str) -> bool:
        try:
            return self._http.get(path).status_code == 200
        except httpx.TransportError:  # refused, DNS failure, timeout, reset
            return False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VitserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncVitserveClient:
    def __init__(
        self, base_url: str = "http://127.0.0.1:8100", api_key: str | None = None, timeout: float = 300.0
    ):
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, trust_env=False
        )

    async def encode(
        self, images: list[ImageLike], return_embeddings: bool = False, request_id: str | None = None
    ) -> dict[str, Any]:
        files, data = _files(images, request_id, return_embeddings)
        try:
            resp = await self._http.post("/encode", files=files, data=data)
        except httpx.HTTPError as exc:
            raise _connection_error(exc) from exc
        return _result(resp)

    async def info(self) -> dict[str, Any]:
        try:
            return _result(await self._http.get("/v1/info"))
        except httpx.HTTPError as exc:
            raise _connection_error(exc) from exc

    async def ready(self) -> bool:
        """True when the encoder accepts work (/ready is 200); False when not, or when unreachable."""
        return await self._probe("/ready")

    async def health(self) -> bool:
        """True when the HTTP server answers /health; False when unreachable."""
        return await self._probe("/health")

    async def _probe(self, path: str) -> bool:
        try:
            return (await self._http.get(path)).status_code == 200
        except httpx.TransportError:  # refused, DNS failure, timeout, reset
            return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncVitserveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
