"""vitserve's side of the same-host hand-over and of the cast before the wire (docs/wire.md, "One write on one
host"; the messages: rpc/handoff.py).

Once, on the first item it hands over, vitserve asks the connector (a hello on a short-lived DEALER of its own,
keyed as the sender) where its incoming area is and what vLLM serves. When vitserve can read the connector's host
token at the path it names (same host, same /dev/shm: containers share it with `--ipc=host` or one /dev/shm volume),
each embedding is written once, straight into the connector's incoming area in vLLM's dtype, and the message
carries its name, size and checksum; otherwise its bytes travel as before, cast to vLLM's dtype here, never after
the wire. A write that fails (a full device: ENOSPC) removes its file and the bytes travel instead.

A pull's answer goes the same way (`pull_file`): a connector's fetch names its incoming area, and the producer
writes the tensor there when it sees that directory (rpc/pull.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import stat
import threading
import time
import uuid as uuid_mod
from pathlib import Path

import torch
import zmq

from vitserve.connector.files import PREFIX
from vitserve.connector.handoff import INCOMING, TOKEN_NAME
from vitserve.connector.pool import claim
from vitserve.handover.mapped import MAPPINGS
from vitserve.rpc.delivery import Delivery, expires_at
from vitserve.rpc.handoff import (
    SAMPLE_BYTES,
    FileEmbedding,
    Info,
    decode_info,
    encode_file,
    encode_hello,
    sampled_crc,
    write_rows,
)
from vitserve.rpc.pull import Area
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.tensors import DTYPES
from vitserve.rpc.wire import ImageEmbedding
from vitserve.rpc.wirekey import configure_dealer, read_key_file

log = logging.getLogger(__name__)

PROBE_WAIT_S = 1.0  # a hello unanswered this long: no same-host path, bytes as before (asked again later)
PROBE_EVERY_S = 30.0


def probe(
    endpoint: str, key_file: str | None, timeout_s: float = PROBE_WAIT_S, security: str = "curve"
) -> Info | None:
    """The connector's info answer, or None (it does not answer in time, or is an older connector)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        tagger = configure_dealer(sock, read_key_file(key_file), security) if key_file is not None else None
        sock.connect(endpoint)
        hello = [encode_hello(uuid_mod.uuid4().hex)]
        sock.send_multipart(hello if tagger is None else tagger.seal(hello))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        answer = sock.recv_multipart()
        return decode_info((answer if tagger is None else tagger.open(answer))[0])
    except Exception as exc:  # an answer that is not an info (an older connector's nack): no same-host path
        log.info("vitserve connector at %s: no same-host hand-over (%s)", endpoint, exc)
        return None
    finally:
        sock.close(0)
        ctx.term()


def shares_directory(where: Info | Area) -> bool:
    """Whether this process sees the connector's very directory: its token file holds its token (a hello's
    answer and a fetch's area name the same three things)."""
    try:
        return Path(where.token_file).read_text() == where.token and os.access(where.incoming, os.W_OK)
    except OSError:
        return False


class SameHost:
    """What the connector said (asked once; again after PROBE_EVERY_S while it did not answer)."""

    def __init__(self, sender: LLMSender) -> None:
        self.sender, self.endpoint = sender, sender.endpoint
        self.info: Info | None = None
        self.local = False  # the incoming area is this host's (and this /dev/shm's)
        self.files = 0  # embeddings handed over as files
        self.recycled = 0  # of those, written over a file of the connector's pool (its pages already there)
        self._asked = -PROBE_EVERY_S
        self._lock = threading.Lock()

    def ask(self) -> Info | None:
        """The connector's info (blocking at most PROBE_WAIT_S, the first time)."""
        with self._lock:
            if (
                self.info is None
                and self.sender.reachable
                and time.monotonic() - self._asked >= PROBE_EVERY_S
            ):
                self._asked = time.monotonic()
                self.info = probe(self.endpoint, self.sender.key_file, security=self.sender.security)
                self.local = (
                    self.info is not None and bool(self.info.incoming) and shares_directory(self.info)
                )
                if self.info is not None:
                    how = "one write into its shared memory" if self.local else "bytes on the wire"
                    log.info(
                        "vitserve connector at %s serves %s: %s", self.endpoint, self.info.dtype or "?", how
                    )
            return self.info

    def forget(self) -> None:
        with self._lock:
            self.info, self.local, self._asked = None, False, -PROBE_EVERY_S
        MAPPINGS.clear()  # the old connector's files: their pages go once nothing maps them

    def dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype an embedding travels in: vLLM's, when the connector said it."""
        info = self.ask()
        return DTYPES[info.dtype] if info is not None and info.dtype in DTYPES else dtype

    def send(self, message: ImageEmbedding, deadline: float, dtype: torch.dtype) -> Delivery:
        """Hand one message over: as a file when the area is local, else its bytes in `dtype`."""
        info = self.ask()
        if self.local and info is not None and not shares_directory(info):
            self.forget()  # its token is gone: the connector restarted (a new directory); ask the new one
            self.ask()
        if self.local and self.info is not None:
            with contextlib.suppress(OSError):
                f = write_file(
                    Path(self.info.incoming), message, dtype, expires_at(deadline), self.info.sample
                )
                self.files += 1
                self.recycled += f.recycled
                return self.sender.submit([encode_file(f)], message_id=f.message_id, deadline=deadline)
        if message.embedding.dtype != dtype:  # cast once, here: the connector never casts what it receives
            message = dataclasses.replace(
                message,
                embedding=message.embedding.to(dtype),
                deepstack=[d.to(dtype) for d in message.deepstack],
            )
        return self.sender.send(message, deadline=deadline)


def pull_file(area: Area, m: ImageEmbedding) -> bytes | None:
    """The answer to a pull's fetch as a file in the connector's incoming area, in the message's own dtype (the
    one the chat request announced), when this process sees that directory; None otherwise (the bytes go).
    OSError when the write fails (its file removed).

    Unlike a push's hello, whose answer comes from the connector at --llm_endpoint, a fetch comes from whoever
    the producer admits: so vitserve writes only into what has the shape of a connector's area (a directory
    `<dir>/.incoming` of this uid, mode 0700, no link, beside `<dir>/.host-token`, `<dir>` named vitserve-ec-*),
    never into a directory a fetch merely names."""
    if not is_connector_area(area) or not shares_directory(area):
        return None
    f = write_file(Path(area.incoming), m, m.embedding.dtype, m.expires_at)
    return encode_file(dataclasses.replace(f, message_id=m.message_id))


def is_connector_area(area: Area) -> bool:
    incoming = Path(area.incoming)
    if not (
        incoming.is_absolute()
        and incoming.name == INCOMING
        and incoming.parent.name.startswith(PREFIX)
        and Path(area.token_file) == incoming.parent / TOKEN_NAME
    ):
        return False
    try:
        st = os.lstat(incoming)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def write_file(
    incoming: Path, m: ImageEmbedding, dtype: torch.dtype, expires: float, sample: int = SAMPLE_BYTES
) -> FileEmbedding:
    """Write `m`'s rows (main and DeepStack levels side by side) in `dtype` into `incoming`: over a file of the
    connector's pool when it has one (its pages are there already: connector/pool.py; through a mapping kept of
    it: mapped.py), else a new file; OSError (ENOSPC, ...) with the file removed."""
    rows = int(m.embedding.shape[0])
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = rows * sum(int(p.shape[1]) for p in (m.embedding, *m.deepstack)) * itemsize
    MAPPINGS.prune()  # files the connector deleted (its pool full, a full device): their pages back first
    claimed = claim(incoming, expected)
    name, fd = claimed or (f"in-{uuid_mod.uuid4().hex}", -1)
    if fd < 0:
        fd = os.open(incoming / name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    parts = [m.embedding, *m.deepstack]
    try:
        if claimed is not None and MAPPINGS.write(incoming / name, fd, parts, dtype, expected):
            nbytes = expected  # through the mapping kept of this pool file (mapped.py), or a new one
        else:
            nbytes = write_rows(fd, parts, dtype)
        crc = sampled_crc(fd, nbytes, sample)
    except BaseException as exc:
        os.unlink(incoming / name)
        log.warning("same-host hand-over: writing %s failed (%s); the bytes go on the wire", name, exc)
        raise
    finally:
        os.close(fd)  # a claimed file's lock goes with it: written, it is announced
    return FileEmbedding(name, nbytes, crc, message_id=uuid_mod.uuid4().hex, request_id=m.request_id,
                         uuid=str(m.uuid), expires_at=float(expires), grid_thw=m.grid_thw, rows=rows,
                         width=nbytes // max(1, rows * itemsize), recycled=claimed is not None, sample=sample,
                         dtype=next(k for k, v in DTYPES.items() if v == dtype))  # fmt: skip
