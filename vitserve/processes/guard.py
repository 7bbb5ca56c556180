"""Imported first by the ranks' forkserver (vitserve/processes/zygote.py): the forkserver dies with the service,
even while it is still importing its preload (a SIGTERM during start-up ends every process within seconds).
Kept to the standard library so it runs within milliseconds of the forkserver's start.

The guard acts only in a process whose environment names the service (SERVICE_PID_ENV, set by zygote.start
for the forkserver it launches); anywhere else importing this module does nothing, so zygote.py and
liveness.py take their constants from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

SERVICE_PID_ENV = "VITSERVE_FORKSERVER_PARENT"  # set by zygote.start for the forkserver it launches
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent exits


def _guard() -> None:
    service_pid = int(os.environ.pop(SERVICE_PID_ENV, "0"))  # popped: the ranks forked from here need it not
    if not service_pid:  # not the forkserver (an import for the constants above): leave the process alone
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(
            OSError
        ):  # no glibc: it still exits at its next read once the service is gone
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != service_pid:  # the service died before the line above ran
        os._exit(0)


_guard()
