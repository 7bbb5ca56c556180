"""The rank's memory reservation for the worst-case batch (docs/engine.md, "The reservation").

    shape = StressShape.of(config, processor.clamp_info())  # the CLI process, once; carried in WorkerArgs
    res, watch = reserve_for_rank(config, shape, encoder, device, rank=r, global_rank=g, say=print)
    # the rank publishes res.bytes (vitserve/reservation_file.py) and runs watch.check() after every batch

Inside: shape.py (what bounds a batch), worst_case.py (the batches), meter.py (CPU RSS / CUDA pool
growth), memory_model.py (extrapolation where the full forward is slow), stress.py (running them),
cache.py (the stored reservation, its key and PeakWatch), record.py (the one Reservation record).
"""

from vitserve.worker.reservation.cache import PeakWatch
from vitserve.worker.reservation.record import Method, Reservation
from vitserve.worker.reservation.reserve import reserve_for_rank
from vitserve.worker.reservation.shape import StressShape

__all__ = ["Method", "PeakWatch", "Reservation", "StressShape", "reserve_for_rank"]
