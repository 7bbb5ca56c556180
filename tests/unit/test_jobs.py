"""engine/jobs.py on plain objects: one Job per unique image, claims refcount it, release() returns orphans."""

from __future__ import annotations

import asyncio
import hashlib

import torch

from tests.fakes import fake_item
from vitserve.config import Config
from vitserve.contract import EncodedImage, PreparedImage
from vitserve.engine.jobs import JobTable
from vitserve.engine.local_cache import make_cache
from vitserve.metrics import Metrics


def image(name: str, seed: int = 0) -> PreparedImage:
    item = fake_item(2, 2, seed)
    return PreparedImage(item, hashlib.sha256(name.encode()).hexdigest(), item.resized_size, 0.0, 0.0)


async def test_identical_images_share_one_job_and_the_last_release_orphans_it():
    table = JobTable(cache=None)
    first = table.claim([image("x"), image("y")], deadline=10.0)
    second = table.claim([image("x")], deadline=20.0)
    assert [c.fresh for c in first + second] == [True, True, False]
    assert first[0].job is second[0].job
    assert first[0].job.claims == 2
    assert first[0].job.deadline == 20.0
    assert table.new_jobs(first + second) == [first[0].job, first[1].job]
    assert len(table) == 2

    x, y = first[0].job, first[1].job
    assert table.release(first) == [y]  # x is still claimed by `second`
    assert table.release(first) == []  # idempotent per claim
    assert table.release(second) == [x]
    assert x.claims == 0
    assert len(table) == 0


async def test_opaque_ids_never_share():
    table = JobTable(cache=None)
    item = fake_item(2, 2, 0)
    claims = table.claim([PreparedImage(item, "label", (1, 1), 0, 0)] * 2, deadline=1.0)
    assert claims[0].job is not claims[1].job
    assert all(c.fresh for c in claims)


async def test_a_settled_job_is_cached_and_the_next_claim_is_a_hit():
    table = JobTable(make_cache(Config(cache_gb=0.001), Metrics()))
    (claim,) = table.claim([image("x")], deadline=1.0)
    encoded = EncodedImage(embedding=torch.ones(4, 8))
    assert claim.job is not None
    assert claim.job.settle(result=encoded)
    assert not claim.job.settle(result=encoded)  # settled once
    await asyncio.sleep(0)  # the future's done callback stores the result in the cache
    table.release([claim])
    (again,) = table.claim([image("x")], deadline=1.0)
    assert again.cached is not None
    assert torch.equal(again.cached.embedding, encoded.embedding)
    assert again.job is None
    assert again.reused
    assert again.timing == (0.0, 0.0)
