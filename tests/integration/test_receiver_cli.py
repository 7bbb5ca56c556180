"""`python -m vitserve.rpc.receiver` (the LLM stand-in of docker/compose.yaml) prints what it receives."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from vitserve.rpc.sender import LLMSender
from vitserve.rpc.wire import ImageEmbedding


def test_receiver_cli_prints_one_line_per_image(tmp_path):
    endpoint = f"ipc://{tmp_path}/llm.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitserve.rpc.receiver", "--bind", endpoint, "--count", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(proc.stdout.readline()) == {"listening": endpoint}
        sender = LLMSender(endpoint)
        deliveries = [
            sender.send(
                ImageEmbedding(
                    request_id="r-7",
                    image_index=k,
                    num_images=2,
                    image_id=f"{k:064x}",
                    model="tiny",
                    grid_thw=(1, 4, 6),
                    embedding=torch.ones(6, 8) * k,
                ),
                deadline=time.monotonic() + 30,
            )
            for k in range(2)
        ]
        lines = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert proc.wait(timeout=30) == 0
        for d in deliveries:
            d.wait(10)  # both acknowledged, the last one too although the receiver exited after it
        sender.close()
    finally:
        proc.kill()
    assert [d["message_id"] for d in lines] == [d.message_id for d in deliveries]
    assert [(d["request_id"], d["image_index"], d["shape"], d["dtype"]) for d in lines] == [
        ("r-7", 0, [6, 8], "float32"),
        ("r-7", 1, [6, 8], "float32"),
    ]
