"""The rank's memory reservation for the worst-case batch (docs/engine.md, "The reservation").

    shape = StressShape.of(config, processor.clamp_info())  # the CLI process, once; carried in WorkerArgs
    res, watch = reserve_for_rank(config, shape, encoder, device, rank=r, global_rank=g, say=print)
    # the rank publishes res.bytes (vitserve/worker/reservation/published.py) and runs watch.check() after every batch

Inside: record.py (what bounds a batch, StressShape, and the one Reservation record), worst_case.py (the
batches), meter.py (CPU RSS / CUDA pool growth, and PeakWatch while serving), memory_model.py
(extrapolation where the full forward is slow), stress.py (running them), sizing.py (a budget from
--visual_mem_gb: budget_search.py's search over budget_model.py's model and record), stored.py (the stored
reservation, the model record and their key), published.py (the reservation file an LLM server reads),
reserve.py (the rank's one call).
"""

from vitserve.worker.reservation.meter import PeakWatch
from vitserve.worker.reservation.record import Method, Reservation, StressShape
from vitserve.worker.reservation.reserve import reserve_for_rank

__all__ = ["Method", "PeakWatch", "Reservation", "StressShape", "reserve_for_rank"]
