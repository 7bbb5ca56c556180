"""The video decoder pool (vitserve/video/decoder_pool.py): real spawned processes under real rlimits.

Each test ends by checking the pool still serves. A decoder that runs past its wall deadline or its CPU limit
is killed (504), one that dies on a call (a signal sent to it mid-decode, as a segfault in FFmpeg would) costs
that call a 400, one that runs out of its address space answers a 400; a slot whose process died between
calls is replaced before it is used. The fuzz test feeds truncations and bit flips of real clips: 400s or 413s
or whole videos, never another error, never a hang. Starting a decoder process imports torch (and, through
vitserve.video's package, transformers): seconds, hence module-scoped pools.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from tests.videos import KINDS, frame_number, make_clip, mutants, reference_frames
from vitserve.errors import InvalidVideo, PayloadTooLarge, UnsupportedVideo, VideoDecodeTimeout, VitserveError
from vitserve.processors.pixels import resize_uint8
from vitserve.video.decode import VideoLimits
from vitserve.video.decoder_pool import DECODER_NICE, VideoDecoder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
DEADLINE_S = 120.0  # generous: the machine running the suite may be busy


@pytest.fixture(scope="module")
def pool():
    with VideoDecoder(slots=2, limits=VideoLimits(max_frames=1000)) as decoder:
        decoder.wait_ready()
        yield decoder


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(31, "mp4")


@pytest.fixture(scope="module")
def heavy() -> bytes:
    """120 frames of 720p: over a second of CPU to decode at full size."""
    return make_clip(120, "mp4", size=(1280, 720), gop=250, preset="ultrafast")


def _serves(pool: VideoDecoder, clip: bytes) -> None:
    frames = pool.decode(clip, (0, 15, 30), (80, 48), deadline_s=DEADLINE_S)
    assert [frame_number(f) for f in frames] == [0, 15, 30]


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_probe_and_decode_in_the_pool_equal_the_straight_decode(pool):
    for kind in KINDS:
        data = make_clip(9, kind)
        reference = reference_frames(data)
        info = pool.probe(data, deadline_s=DEADLINE_S)
        assert info.total_frames == len(reference) == 9
        frames = pool.decode(data, (0, 4, 8), (64, 40), deadline_s=DEADLINE_S)
        for frame, index in zip(frames, (0, 4, 8), strict=True):
            np.testing.assert_array_equal(frame, resize_uint8(reference[index], (64, 40)))


def test_decoder_processes_yield_the_cpu_to_the_server(pool, clip):
    """Every thread of every decoder process runs at the server's nice value + DECODER_NICE (at most 19)."""
    _serves(pool, clip)  # each slot has started (and decoded: FFmpeg's threads inherit the value)
    _serves(pool, clip)
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + DECODER_NICE)
    for pid in pool.pids():
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                nice = int(stat.read().rsplit(")", 1)[1].split()[16])
            assert nice == expected, (pid, task, nice)


def test_bad_inputs_are_400s_and_limits_413s(pool, clip):
    rng = np.random.default_rng(2)
    for blob in (b"", bytes(rng.integers(0, 256, 4096, dtype=np.uint8)), clip[: len(clip) // 2]):
        with pytest.raises(InvalidVideo) as err:
            pool.probe(blob, deadline_s=DEADLINE_S)
        assert err.value.status == 400
    with pytest.raises(UnsupportedVideo):
        pool.probe(b"GIF89a" + bytes(100), deadline_s=DEADLINE_S)
    with pytest.raises(PayloadTooLarge, match="--max_video_frames=1000"):
        pool.probe(make_clip(1001, "mkv", size=(32, 32), preset="ultrafast"), deadline_s=DEADLINE_S)
    _serves(pool, clip)


def test_a_decoder_past_its_deadline_is_killed_and_replaced(pool, clip, heavy):
    before = set(pool.pids())
    started = time.monotonic()
    with pytest.raises(VideoDecodeTimeout, match="deadline of 0.05 s.*--request_timeout_s") as err:
        pool.decode(heavy, tuple(range(120)), None, deadline_s=0.05)
    assert err.value.status == 504
    assert time.monotonic() - started < 10  # the caller is answered at the deadline, not after the decode
    assert len(set(pool.pids()) - before) == 1  # the slot's process was replaced
    _serves(pool, clip)
    _serves(pool, clip)  # both slots


def test_a_decoder_that_crashes_mid_decode_costs_its_call_a_400(pool, clip, heavy):
    """SIGSEGV sent to the process once it is busy decoding: the call is a 400 naming the signal."""
    pids = pool.pids()
    idle = {pid: _cpu_ticks(pid) for pid in pids}

    def crash_the_busy_one() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for pid in pids:
                if _cpu_ticks(pid) > idle[pid] + 5:  # 50 ms of CPU: it is decoding
                    os.kill(pid, signal.SIGSEGV)
                    return
            time.sleep(0.005)

    killer = threading.Thread(target=crash_the_busy_one)
    killer.start()
    with pytest.raises(InvalidVideo, match="crashed on this video \\(signal SIGSEGV\\)") as err:
        pool.decode(heavy, tuple(range(120)), None, deadline_s=DEADLINE_S)
    killer.join()
    assert err.value.status == 400
    _serves(pool, clip)
    _serves(pool, clip)


def _dead(pid: int) -> bool:
    """The process has exited (a zombie until the pool reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_decoder_that_died_between_calls_is_replaced_before_use(pool, clip):
    pids = pool.pids()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    while not all(_dead(pid) for pid in pids):
        time.sleep(0.01)
    _serves(pool, clip)
    _serves(pool, clip)


def test_the_cpu_limit_stops_a_decoder(clip, heavy):
    """RLIMIT_CPU: a call allowed under a second of CPU time is ended by the kernel (SIGXCPU): a 504.

    The kernel counts whole seconds, so a call may use what is left of the process's current CPU second (up to
    1 s). One heavy decode takes 0.3-1.5 s of CPU, depending on the CPU: the calls' CPU adds up until one does
    not fit in what is left, within a few calls on any CPU (at most 1/c + 1 for c seconds a call)."""
    with VideoDecoder(slots=1, cpu_s=0.001) as pool:
        with pytest.raises(VideoDecodeTimeout, match="deadline of 0.01 s.*still starting"):
            pool.probe(clip, deadline_s=0.01)  # the deadline covers the wait for a starting process
        pool.wait_ready()
        with pytest.raises(VideoDecodeTimeout, match="CPU time") as err:
            _decode_until_it_fails(pool, heavy, calls=20)
        assert err.value.status == 504
        # the replaced decoder serves again: with room for a small call (at 0.001 s, what is left of its current
        # CPU second after its start-up may be less than even a small call needs)
        pool.cpu_s = 2.0
        assert pool.probe(clip, deadline_s=DEADLINE_S).total_frames == 31


def _decode_until_it_fails(pool: VideoDecoder, data: bytes, calls: int) -> None:
    for _ in range(calls):
        pool.decode(data, tuple(range(120)), (640, 360), deadline_s=DEADLINE_S)


def test_the_memory_limit_stops_a_decoder(clip, heavy):
    """RLIMIT_AS: 120 full 720p frames (330 MB) do not fit in 64 MiB more than the started process: a 400."""
    with VideoDecoder(slots=1, memory_bytes=64 * 1024 * 1024) as pool:
        pool.wait_ready()
        with pytest.raises(
            InvalidVideo, match="more memory than a decoder process may use.*0.0625 GiB"
        ) as err:
            pool.decode(heavy, tuple(range(120)), None, deadline_s=DEADLINE_S)
        assert err.value.status == 400
        _serves(pool, clip)


def _fuzz(pool: VideoDecoder, per_kind: int) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    for seed, kind in enumerate(("mp4", "mkv", "webm")):
        for blob in mutants(make_clip(31, kind), per_kind, seed):
            try:
                info = pool.probe(blob, deadline_s=DEADLINE_S)
                frames = pool.decode(blob, tuple(range(info.total_frames)), (40, 24), deadline_s=DEADLINE_S)
                assert frames.shape == (info.total_frames, 24, 40, 3)
                outcome = "decoded"
            except VitserveError as exc:  # anything else fails the test
                if exc.status not in (400, 413):
                    pytest.fail(f"a fuzzed {kind} clip got {exc.status}: {exc.message}")
                outcome = exc.code
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def test_fuzzed_clips_are_400s_or_whole_videos_quick(pool, clip):
    outcomes = _fuzz(pool, per_kind=15)
    assert sum(outcomes.values()) == 45
    assert outcomes.get("invalid_video", 0) > 0
    _serves(pool, clip)


@pytest.mark.slow
def test_fuzzed_clips_are_400s_or_whole_videos(pool, clip):
    outcomes = _fuzz(pool, per_kind=400)
    assert sum(outcomes.values()) == 1200
    _serves(pool, clip)
