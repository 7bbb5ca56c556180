"""Activation memory of the worst case, extrapolated from a few smaller shapes where the full forward is slow.

On a CPU one production forward of the demo at the default budget (8,192 merged tokens, 32,768 patches in
one image) takes minutes, longer than the whole start-up may. So a rank measures the worst-case batch of
worst_case.py at a few smaller budgets (the probes, each run through the production `encoder.encode` and
measured like the full stress, stress.py and meter.py) and fits

    bytes = a + b*n + c*sum(n_i^2),  b, c >= 0

over n, the image tokens of the batch, and n_i, the tokens of each attention unit (an image; an InternVL
tile). Every layer's activations are linear in the patch count (linear layers, norms, the merger, the pixel
tensor itself) except attention scores that a kernel materialises, which are quadratic per unit; on CPU
c is 0 (memory_fit_is_quadratic). The prediction at the budget's worst case, times MODEL_FACTOR, is the
reservation.

Which shapes: the worst case at max(budget/128, MIN_PROBE_TOKENS) tokens, doubling up to budget/4, until
MIN_PROBES are in and one took RESERVATION_PROBE_TARGET_S (budget 0: fractions of the processor's largest
image).
Seconds are fitted the same way (never below the largest probe's time per token); when the full-budget
stress is predicted to take at most FULL_STRESS_MAX_S per forward (a GPU, a small tower, a small budget) the
rank runs the real full-budget stress instead and nothing is extrapolated. Probes too small to time (a few
milliseconds) do not decide that: more are measured first (see estimate).

Why the result is safe: the reservation must hold the live peak while serving, which on CPU is above one
forward's growth (glibc's heap fragments over batches of other shapes). MODEL_FACTOR bounds that peak over
the prediction directly: tests/integration/test_memory_model.py (every family, TP 1 and 2, real spawned
ranks) runs the probes, the whole full-budget stress and then full-budget batches of random compositions,
and checks the peak against the published bytes. The fit cannot bend down (b, c >= 0). A live peak above the
reservation is caught after every batch (cache.py PeakWatch) and makes the next start measure again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The published bytes per predicted byte. The prediction is for one forward of the worst case; the peak while
# serving adds the heap that batches of other compositions fragment. On the tiny towers, whose batch's pixels
# are a large share of the activations, that peak reached about 2.3 times the prediction (and the full
# stress alone, which the serving peak only adds to, about 2); a large tower's ratio is lower (the demo's one
# full forward grew by three quarters of its prediction). No heap factor (meter.py) on top: this one is
# measured against the serving peak itself. docs/engine.md, "The reservation", gives the reasoning;
# bench/reservation.py measures the ratios.
MODEL_FACTOR = 3.0
FULL_STRESS_MAX_S = 3.0  # run the real full-budget stress when it is predicted to take at most this
RESERVATION_PROBE_TARGET_S = 1.0  # add probes (doubling) until one takes this long
FIRST_PROBE_FRACTION = 128  # the first probe is budget // this tokens ...
MIN_PROBE_TOKENS = 64  # ... and at least this many (smaller shapes measure mostly noise)
LARGEST_PROBE_FRACTION = 4  # no probe above budget // this: beyond it, run the full stress
MIN_PROBES = 3  # a quadratic needs three points


@dataclass(frozen=True)
class Shape:
    """A batch as the model sees it: total image tokens and the sum of squares of its attention units."""

    tokens: int  # n: image tokens in the batch
    squares: int  # sum over attention units (images; InternVL tiles) of their tokens squared

    @classmethod
    def of_units(cls, units: Sequence[int]) -> Shape:
        return cls(sum(units), sum(u * u for u in units))


@dataclass(frozen=True)
class Probe:
    """One measured shape: the worst-case batch at `budget` tokens."""

    budget: int
    shape: Shape
    bytes: int  # activation memory measured (CPU: RSS growth; CUDA: allocator growth), before margins
    seconds: float  # wall time of its forward


@dataclass(frozen=True)
class Fit:
    """y = a + b*tokens + c*squares with b, c >= 0 (c*squares: attention scores, quadratic per unit)."""

    a: float
    b: float
    c: float

    def at(self, shape: Shape) -> float:
        return self.a + self.b * shape.tokens + self.c * shape.squares


@dataclass(frozen=True)
class Estimate:
    """What the probes say about the full budget's worst case."""

    probes: tuple[Probe, ...]
    memory: Fit
    time: Fit
    full: Shape

    @property
    def predicted_bytes(self) -> int:
        """The fitted activation bytes at the full budget, never below the largest probe's."""
        return int(max(self.memory.at(self.full), *(p.bytes for p in self.probes)))

    @property
    def reserved_bytes(self) -> int:
        return int(self.predicted_bytes * MODEL_FACTOR)

    @property
    def predicted_seconds(self) -> float:
        """One forward of the full budget's worst case: the fitted time, never below the largest probe's time
        per token times the full budget's tokens (the work per token does not fall as a batch grows)."""
        largest = self._largest
        per_token = largest.seconds * self.full.tokens / max(largest.shape.tokens, 1)
        return max(self.time.at(self.full), per_token, *(p.seconds for p in self.probes))

    @property
    def upper_bound_seconds(self) -> float:
        """An upper bound of one full forward's seconds from the largest probe alone: with
        seconds = a + b*tokens + c*squares and a, b, c >= 0, the full shape takes at most the probe's time
        times the larger of its ratios of tokens and of squares. Loose (quadratic where the forward is
        mostly linear), but it cannot be fooled by probes too small to show attention's quadratic cost."""
        largest = self._largest
        ratio = max(
            self.full.tokens / max(largest.shape.tokens, 1),
            self.full.squares / max(largest.shape.squares, 1),
            1.0,
        )
        return largest.seconds * ratio

    @property
    def _largest(self) -> Probe:
        return max(self.probes, key=lambda p: p.shape.tokens)


def fit(points: Sequence[tuple[Shape, float]], *, quadratic: bool = True) -> Fit:
    """Least squares y = a + b*tokens + c*squares with b, c >= 0 (c = 0 unless `quadratic`).

    Memory of a forward never grows slower than linearly in the tokens, so a fit that bends down (c < 0:
    noise at small shapes) is replaced by the best line, and a line falling with n by the largest value.
    Probes whose squares are proportional to their tokens (every unit the same size: InternVL tiles, images
    at the processor's cap) cannot separate c from b; the line then carries both, which is exact for a
    full-budget batch of the same units.
    """
    import numpy as np

    n = np.array([float(s.tokens) for s, _ in points])
    q = np.array([float(s.squares) for s, _ in points])
    y = np.array([float(v) for _, v in points])
    ones = np.ones_like(n)
    quad = np.stack([ones, n, q], axis=1)
    if quadratic and len(points) >= 3 and np.linalg.matrix_rank(quad) == 3:
        a, b, c = np.linalg.lstsq(quad, y, rcond=None)[0]
        if b >= 0 and c >= 0:
            return Fit(float(a), float(b), float(c))
    line = np.stack([ones, n], axis=1)
    if np.linalg.matrix_rank(line) == 2:
        a, b = np.linalg.lstsq(line, y, rcond=None)[0]
        if b >= 0:
            return Fit(float(a), float(b), 0.0)
    return Fit(float(y.max()), 0.0, 0.0)


def memory_fit_is_quadratic(device_type: str) -> bool:
    """Whether the memory fit may have a quadratic term. Not on CPU: every attention of the production
    forward is torch's scaled_dot_product_attention without a mask (vitserve.model.fast's packed attention;
    InternVL's SDPA path), which on CPU runs the flash kernel, whose memory is linear in the sequence; and
    three probes at 1/128..1/32 of the budget cannot bound a quadratic term anyway: RSS noise of a few MiB
    fitted as curvature grows 1024-fold at the budget (the demo's probes gave 55 GB for a 1.2 GB peak).
    On CUDA, SDPA may fall back to the math kernel (dtype, head size), which holds the n^2 scores; there
    the probes are fast, so more and larger ones are measured (up to budget/4) before extrapolating."""
    return device_type != "cpu"


def probe_budgets(budget: int) -> list[int]:
    """The probe budgets, smallest first: from max(budget/128, 64) doubling up to budget/4. Fewer than
    MIN_PROBES means the budget is too small to extrapolate from anything smaller."""
    out: list[int] = []
    b = max(budget // FIRST_PROBE_FRACTION, MIN_PROBE_TOKENS)
    while b <= budget // LARGEST_PROBE_FRACTION:
        out.append(b)
        b *= 2
    return out


def estimate(
    scale: int,
    full: Shape,
    measure: Callable[[int], Probe],
    *,
    fast_enough_s: float = FULL_STRESS_MAX_S,
    max_probes: int | None = None,
    quadratic_memory: bool = True,
) -> Estimate | None:
    """Measure probes smallest first; None when the full-budget stress is cheap enough to run instead.

    scale: what the probe budgets are fractions of (the budget; with budget 0 the largest image). full: the
    shape of the full budget's worst case. measure(b): the worst case at budget b, measured like the full
    stress. Stops once MIN_PROBES are in and either the full stress is predicted to take <= fast_enough_s
    (None: run it) or the last probe took RESERVATION_PROBE_TARGET_S (or max_probes are in). The prediction
    is trusted early only when even the quadratic bound from the largest probe (upper_bound_seconds) is within
    fast_enough_s; otherwise the probes go on, and it is trusted at the last one. Probes of a few
    milliseconds are mostly noise: three of them (a tiny Qwen2-VL at 64-256 tokens of 8,192, on a CPU)
    once fitted ~1.3 s for a forward that takes 11-15 s, and the five-forward stress took 55 s.
    quadratic_memory: fit c for the memory (see memory_fit_is_quadratic); the time is always fitted with it
    (attention's compute is quadratic in each image whatever the kernel).
    """
    candidates = probe_budgets(scale)[:max_probes]
    if len(candidates) < MIN_PROBES:
        return None
    probes: list[Probe] = []
    for b in candidates:
        probes.append(measure(b))
        if len(probes) < MIN_PROBES:
            continue
        est = _estimate(probes, full, quadratic_memory)
        last = len(probes) == len(candidates)
        if est.predicted_seconds <= fast_enough_s and (last or est.upper_bound_seconds <= fast_enough_s):
            return None
        if probes[-1].seconds >= RESERVATION_PROBE_TARGET_S:
            break
    return _estimate(probes, full, quadratic_memory)


def _estimate(probes: Sequence[Probe], full: Shape, quadratic_memory: bool) -> Estimate:
    memory = fit([(p.shape, p.bytes) for p in probes], quadratic=quadratic_memory)
    time = fit([(p.shape, p.seconds) for p in probes])
    return Estimate(probes=tuple(probes), memory=memory, time=time, full=full)


def describe(est: Estimate) -> str:
    """One line for the log: the shapes measured and what they predict."""
    shapes = ", ".join(
        f"{p.shape.tokens} tokens: {p.bytes / 2**20:.1f} MiB in {p.seconds:.1f} s" for p in est.probes
    )
    return (
        f"extrapolated from {len(est.probes)} shapes ({shapes}) to {est.full.tokens} tokens: "
        f"{est.predicted_bytes / 2**20:.1f} MiB, times {MODEL_FACTOR} "
        f"(the full stress was predicted to take ~{est.predicted_seconds:.0f} s)"
    )
