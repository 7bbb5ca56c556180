"""Rank loop properties with real gloo ranks (docs/design.md invariants): identical batch sequences on every rank
(4), idle past --dist_timeout_s (6), dp=2 sharing one queue (5), garbage on the status socket and loopback-only
ranks (15)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal

import pytest
import torch
import zmq

from tests.e2e.netcheck import listening_sockets
from tests.fakes import FakeEncoderFactory, fake_item, fake_reference
from tests.integration.engine_helpers import deadline, encode, kill_quietly, make_config, running_engine
from vitserve.contract import Readiness


def _read_logs(log_dir) -> dict[str, list[str]]:
    logs = {}
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            logs[name] = f.read().split()
    return logs


async def _mixed_load(engine, n_requests: int, seed: int = 0):
    reqs = [
        [
            fake_item(1 + (i * 7 + k) % 6, 1 + (i + 3 * k) % 5, seed=seed + 31 * i + k)
            for k in range(1 + i % 4)
        ]
        for i in range(n_requests)
    ]

    async def one(i, items):
        await asyncio.sleep(0.01 * (i % 5))  # staggered arrivals: batches of varying composition
        return await encode(
            engine,
            f"r{i}",
            items,
            [str(k) for k in range(len(items))],
            deadline=deadline(),
            return_embeddings=True,
        )

    outs = await asyncio.gather(*(one(i, items) for i, items in enumerate(reqs)))
    for items, results in zip(reqs, outs, strict=True):
        for item, res in zip(items, results, strict=True):
            torch.testing.assert_close(res.embedding, fake_reference(item), rtol=1e-5, atol=1e-5)


async def test_every_rank_runs_the_identical_batch_sequence(tmp_path):
    log_dir = tmp_path / "hashes"
    log_dir.mkdir()
    config = make_config(tmp_path, tp=2, visual_batch_max_tokens=48, visual_infer_batch_size=4)
    async with running_engine(config, FakeEncoderFactory(hash_log_dir=str(log_dir))) as engine:
        await _mixed_load(engine, 16)
        batches = engine.metrics.value("vitserve_batch_images_count")
    logs = _read_logs(log_dir)
    assert len(logs) == 2
    rank0, rank1 = logs.values()
    assert len(rank0) == batches > 4
    assert rank0 == rank1


@pytest.mark.parametrize("idle_s", [6.0])
async def test_idle_past_the_dist_timeout_then_serve(tmp_path, idle_s):
    config = make_config(tmp_path, tp=2, heartbeat_s=1.0, dist_timeout_s=3.0)
    async with running_engine(config) as engine:
        await asyncio.sleep(idle_s)  # twice --dist_timeout_s: only heartbeats keep rank 1's broadcast alive
        assert engine.readiness() == Readiness(True, "ok")
        item = fake_item(3, 3, seed=5)
        (res,) = await encode(
            engine, "after-idle", [item], ["a"], deadline=deadline(), return_embeddings=True
        )
        torch.testing.assert_close(res.embedding, fake_reference(item), rtol=1e-5, atol=1e-5)
        assert engine.metrics.value("vitserve_heartbeats_total") >= idle_s / 1.0 - 2


async def test_dp2_both_groups_serve_and_one_survives_the_other(tmp_path):
    log_dir = tmp_path / "hashes"
    log_dir.mkdir()
    # heartbeat 2 s: this test is about sharing the queue, not about detecting hangs fast
    config = make_config(
        tmp_path, dp=2, visual_batch_max_tokens=16, visual_infer_batch_size=1, heartbeat_s=2.0
    )
    factory = FakeEncoderFactory(hash_log_dir=str(log_dir), sleep_s=0.2)
    async with running_engine(config, factory) as engine:
        await _mixed_load(engine, 6)
        counts = [len(v) for v in _read_logs(log_dir).values()]
        assert len(counts) == 2
        assert min(counts) >= 2  # the idle group pulls from the shared queue too

        kill_quietly(engine.worker_pids()[0][0], signal.SIGKILL)
        while engine.groups()[0]["state"] != "failed":
            await asyncio.sleep(0.05)
        assert engine.groups()[1]["state"] == "ready"
        readiness = engine.readiness()
        assert (
            not readiness.ready
        )  # a dead rank is never "ready" (docs/design.md invariant 5), though group 1 still serves
        assert "group 0" in readiness.reason
        await _mixed_load(engine, 4, seed=1000)  # group 1 serves the whole queue
        assert not engine.failed.is_set()
        assert engine.metrics.value("vitserve_workers_ready") == 1


async def test_garbage_and_pickle_on_the_status_socket_are_dropped(tmp_path):
    async with running_engine(make_config(tmp_path)) as engine:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(f"ipc://{engine._ipc_dir}/status")
        sock.send(b"\x00garbage")
        sock.send(pickle.dumps({"kind": "result"}))
        sock.send_multipart([b"\x82\xa1v\x01\xa4kind\xa6result", b"x"])  # v1 header, wrong frames
        sock.close(linger=1000)
        ctx.term()
        item = fake_item(2, 2, seed=1)
        (res,) = await encode(engine, "after", [item], ["a"], deadline=deadline(), return_embeddings=True)
        torch.testing.assert_close(res.embedding, fake_reference(item), rtol=1e-5, atol=1e-5)
        assert engine.readiness() == Readiness(True, "ok")


async def test_ranks_listen_on_loopback_only(tmp_path):
    async with running_engine(make_config(tmp_path, tp=2)) as engine:
        pids = [pid for group in engine.worker_pids().values() for pid in group] + [os.getpid()]
        found = listening_sockets(pids)
    assert found  # gloo's pairs listen somewhere: it must be loopback
    assert {addr for addr, _ in found} <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, found


async def test_a_blocked_event_loop_does_not_kill_healthy_ranks(tmp_path):
    import time

    async with running_engine(make_config(tmp_path, heartbeat_s=1.0)) as engine:
        time.sleep(3.0)  # the API process hogs its loop (3 x heartbeat): ALIVE reports pile up unread
        assert engine.readiness() == Readiness(True, "ok")
        await asyncio.sleep(1.0)  # the watchdog and the status reader run again
        assert engine.groups()[0]["state"] == "ready"
        assert engine.readiness() == Readiness(True, "ok")
        item = fake_item(2, 2, seed=3)
        (res,) = await encode(engine, "after", [item], ["a"], deadline=deadline(), return_embeddings=True)
        torch.testing.assert_close(res.embedding, fake_reference(item), rtol=1e-5, atol=1e-5)
