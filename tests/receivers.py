"""Receivers for the delivery tests: one in its own process (tests/receiver_child.py), one on a thread."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from vitserve.rpc import EmbeddingReceiver, ImageEmbedding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ReceiverProcess:
    """tests/receiver_child.py as a subprocess; `messages` and `stats` fill in as it prints them."""

    def __init__(self, endpoint: str, *, delay_s: float = 0.0, read_after_s: float = 0.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.receiver_child", endpoint, "--delay_s", str(delay_s),
             "--read_after_s", str(read_after_s)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.messages: list[dict[str, Any]] = []
        self.stats: dict[str, int] = {}
        self.listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self.listening.wait(60):
            self.kill()
            raise AssertionError("the receiver process did not bind")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            data = json.loads(line)
            if "listening" in data:
                self.listening.set()
            elif "stats" in data:
                self.stats = data["stats"]
            else:
                self.messages.append(data)

    def wait_for(self, predicate, what: str, limit_s: float = 30.0) -> None:
        end = time.monotonic() + limit_s
        while not predicate():
            assert time.monotonic() < end, f"the receiver process never {what}: {self.messages} {self.stats}"
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to close its socket cleanly."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class ReceiverThread:
    """An EmbeddingReceiver in this process whose thread recv()s (and so acknowledges) everything:
    `got` lists every message, `take(n)` hands out the next n in arrival order."""

    def __init__(self, endpoint: str):
        self.rx = EmbeddingReceiver(endpoint)
        self.got: list[ImageEmbedding] = []
        self._queue: queue.SimpleQueue[ImageEmbedding] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                msg = self.rx.recv(timeout_s=0.1)
                self.got.append(msg)
                self._queue.put(msg)

    def take(self, n: int, timeout_s: float = 60.0) -> list[ImageEmbedding]:
        """The next n messages; raises queue.Empty when one does not come within timeout_s."""
        return [self._queue.get(timeout=timeout_s) for _ in range(n)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.rx.close()

    def __enter__(self) -> ReceiverThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
