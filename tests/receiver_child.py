"""An LLM-side EmbeddingReceiver in its own process, for the delivery tests (docs/wire.md).

    python -m tests.receiver_child ENDPOINT [--delay_s S] [--read_after_s S]

Prints {"listening": endpoint}, then one JSON line per message recv() returned (and so acknowledged),
and a {"stats": ...} line whenever its drop counters change. --delay_s sleeps before each recv() (a
slow application); --read_after_s reads nothing for that long first (a hung one). Runs until killed.
"""

from __future__ import annotations

import argparse
import json
import time

from vitserve.rpc import EmbeddingReceiver


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--delay_s", type=float, default=0.0)
    parser.add_argument("--read_after_s", type=float, default=0.0)
    args = parser.parse_args()
    with EmbeddingReceiver(args.endpoint) as rx:
        print(json.dumps({"listening": rx.endpoint}), flush=True)
        time.sleep(args.read_after_s)
        stats: dict[str, int] = {}
        while True:
            time.sleep(args.delay_s)
            try:
                msg = rx.recv(timeout_s=0.2)
                line = {
                    "request_id": msg.request_id,
                    "image_index": msg.image_index,
                    "message_id": msg.message_id,
                }
                print(json.dumps(line), flush=True)
            except TimeoutError:
                pass
            now = {"received": rx.received, "expired": rx.expired, "duplicates": rx.duplicates}
            if now != stats:
                stats = now
                print(json.dumps({"stats": now}), flush=True)


if __name__ == "__main__":
    main()
