"""OpenAI chat completions as the front-door tests send and read them: one image and a question, greedy,
with logprobs; streamed answers are assembled from their server-sent events."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import httpx


def data_url(image: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(image).decode()


def chat_request(
    model: str, image_part: dict, *, question: str = "describe it", before: str = "", stream: bool = False
) -> dict:
    """Greedy, 12 tokens, the top logprob of each; `before` is text placed before the image."""
    content = ([{"type": "text", "text": before}] if before else []) + [
        image_part,
        {"type": "text", "text": question},
    ]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def image_url_part(image: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


@dataclass
class Answer:
    tokens: list[str]
    logprobs: list[float]
    prompt_tokens: int
    text: str


def complete(base_url: str, body: dict, timeout: float = 120) -> Answer:
    """POST /v1/chat/completions; the answer, streamed or not (a non-200 raises with the body)."""
    url = base_url + "/v1/chat/completions"
    if not body.get("stream"):
        r = httpx.post(url, json=body, timeout=timeout, trust_env=False)
        assert r.status_code == 200, r.text
        data = r.json()
        content = data["choices"][0]["logprobs"]["content"]
        return Answer(
            [c["token"] for c in content],
            [c["logprob"] for c in content],
            data["usage"]["prompt_tokens"],
            data["choices"][0]["message"]["content"],
        )
    tokens, logprobs, text, prompt = [], [], [], -1
    with httpx.stream("POST", url, json=body, timeout=timeout, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        data = json.loads(event)
        assert "error" not in data, data
        if data.get("usage"):
            prompt = data["usage"]["prompt_tokens"]
        for choice in data["choices"]:
            text.append(choice["delta"].get("content") or "")
            for c in (choice.get("logprobs") or {}).get("content") or []:
                tokens.append(c["token"])
                logprobs.append(c["logprob"])
    return Answer(tokens, logprobs, prompt, "".join(text))


def assert_same_answer(a: Answer, b: Answer, tol: float = 1e-4) -> None:
    """Identical tokens and prompt length, logprobs within `tol` (float round-off of the same math)."""
    assert a.tokens == b.tokens, (a.tokens, b.tokens)
    assert a.prompt_tokens == b.prompt_tokens
    assert len(a.logprobs) == len(a.tokens) > 0
    worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert worst <= tol, f"logprobs differ by {worst:.2e} > {tol:.0e}"
