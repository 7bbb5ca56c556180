"""Every fenced shell (bash/sh/shell/console) and Python block in README.md and docs/*.md runs as written.

Blocks are found by tests/docblocks.py in every docs/*.md, whoever wrote it; a new block is tested the day it
is written. Each block is one test, id `FILE:LINE`.

Markers: an HTML comment on the line right before the opening fence (invisible when rendered):
- `<!-- no-run: REASON -->`: not run, e.g. it needs a GPU, vLLM, Docker or a real 7B checkpoint. The reason is
  required; a marker without one fails (so does a marker this file does not know).
- `<!-- slow: REASON -->`: run only with `-m slow` (it takes minutes); the reason is required.
- `<!-- server -->` (may be combined: `<!-- slow server: REASON -->`): the block starts vitserve in the
  foreground and never returns; it must end by exec-ing the server (scripts/serve.sh does, and so does a
  one-command block). It runs from the repository root with `VITSERVE_PORT=0` and `VITSERVE_MODEL` = the
  tiny checkpoint below (a `--model` in the block wins), so the server binds a free port, which is read from its "serving on http://127.0.0.1:PORT" line; the test waits for `/ready` 200,
  sends SIGTERM and expects exit code 0.
Anything else runs in the default suite and fails the test when it fails.

How blocks run:
- Shell blocks: `bash -e -o pipefail -c BLOCK` (console blocks: only their `$ ` lines), in a fresh working
  directory per document that holds the files the docs name (FIXTURES: `photo.jpg`), with the venv's bin/
  first on PATH.
- Python blocks: exec'd in this process, in that working directory, compiled with the document's name and
  line numbers (a traceback points into the .md file). The Python blocks of one document share one
  namespace and run in order, as a reader pasting them into one session would.
- A block that contains `http://127.0.0.1:8100` (vitserve's default address) gets a real server: the test
  starts `python -m vitserve.cli` on a free port (one per document, started when first needed) over a tiny
  real Qwen2-VL checkpoint (tests/checkpoints.py) and replaces that address in the block's text with the
  server's. A shell block talking to it must not print an error body (`"error":`), since curl -s exits 0 on
  HTTP errors.
- Environment for every block: `VITSERVE_MODEL` = that checkpoint's directory and `VITSERVE_LLM_ENDPOINT` =
  `ipc://<tmp>/ipc/llm.sock` (the directory does not exist: the docs must create it), the same values the
  server was started with; `VITSERVE_RUNTIME_DIR` = a temp directory. The server gets `--llm_endpoint` only
  for a document whose blocks bind an `EmbeddingReceiver` (else every /encode would wait for an
  acknowledgement nobody sends: docs/wire.md); such a server counts as up once `/v1/info` answers 200, as
  `/ready` waits for the receiver the document binds later.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.checkpoints import make_checkpoint
from tests.cli import Cli
from tests.docblocks import ROOT, Block, blocks, doc_files

DOC_URL = "http://127.0.0.1:8100"
SERVER_ARGS = [
    "--port",
    "0",
    "--visual_batch_max_tokens",
    "256",
    "--device",
    "cpu",
    "--heartbeat_s",
    "2",
    "--dist_timeout_s",
    "120",
]


def _photo() -> bytes:
    """112x84: a whole number of 28-px units, so no processor resizes it (12 tokens on the tiny Qwen2-VL)."""
    pixels = np.random.default_rng(0).integers(0, 256, (84, 112, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


FIXTURES = {"photo.jpg": _photo}


def _clean_env(runtime_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
    env.update(
        VITSERVE_RUNTIME_DIR=str(runtime_dir),
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
    )
    return env


def stop(served: Cli) -> int:
    """SIGTERM (vitserve drains and exits 0); the process group is killed if it does not go."""
    try:
        return served.terminate(120)
    finally:
        served.stop()


class DocSession:
    """One document's working directory, environment, Python namespace and (lazily) server."""

    def __init__(self, doc: Path, tmp: Path, checkpoint: Path):
        self.doc, self.tmp = doc, tmp
        self.workdir = tmp / "work"
        self.workdir.mkdir()
        for name, make in FIXTURES.items():
            (self.workdir / name).write_bytes(make())
        self.env = {
            "VITSERVE_MODEL": str(checkpoint),
            "VITSERVE_LLM_ENDPOINT": f"ipc://{tmp}/ipc/llm.sock",
            "VITSERVE_RUNTIME_DIR": str(tmp / "rt"),
        }
        self.namespace: dict = {"__name__": "__main__"}
        self._server: Cli | None = None

    def server(self) -> Cli:
        if self._server is None:
            args = ["--model", self.env["VITSERVE_MODEL"]]
            binds = any(
                "EmbeddingReceiver(" in b.commands()
                for b in blocks(self.doc)
                if b.is_python and "no-run" not in b.tags
            )
            if binds:
                args += ["--llm_endpoint", self.env["VITSERVE_LLM_ENDPOINT"]]
            env = {**_clean_env(self.tmp / "rt"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            self._server = Cli([*args, *SERVER_ARGS], env=env, session=True)
            self._server.wait_ready(240, "/v1/info" if binds else "/ready")
        return self._server

    def close(self) -> None:
        if self._server is not None:
            code = stop(self._server)
            assert code == 0, self._server.tail()
            self._server = None


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    checkpoint = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("ckpt"))
    opened: dict[Path, DocSession] = {}

    def session(doc: Path) -> DocSession:
        if doc not in opened:
            for other in opened.values():  # blocks run document by document: one server at a time
                other.close()
            opened[doc] = DocSession(doc, tmp_path_factory.mktemp(doc.stem), checkpoint)
        return opened[doc]

    yield session
    for s in opened.values():
        s.close()


def _params():
    for doc in doc_files():
        for block in blocks(doc):
            marks = [pytest.mark.slow, pytest.mark.timeout(1800)] if "slow" in block.tags else []
            yield pytest.param(block, id=block.id, marks=marks)


def _with_server(code: str, session: DocSession) -> str:
    return code.replace(DOC_URL, session.server().url) if DOC_URL in code else code


def run_python(block: Block, session: DocSession, monkeypatch) -> None:
    code = _with_server(block.commands(), session)
    monkeypatch.chdir(session.workdir)
    for name, value in session.env.items():
        monkeypatch.setenv(name, value)
    exec(compile("\n" * (block.line - 1) + code, str(block.doc), "exec"), session.namespace)


def run_shell(block: Block, session: DocSession) -> None:
    code = _with_server(block.commands(), session)
    env = {**_clean_env(session.tmp / "rt"), **session.env}
    r = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=session.workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, f"exit {r.returncode}\n{code}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    if code != block.commands():  # it talked to the server: an error answer is a failure too
        assert '"error":' not in r.stdout, r.stdout


def run_server_block(block: Block, tmp: Path, checkpoint: str) -> None:
    env = {**_clean_env(tmp / "rt"), "VITSERVE_PORT": "0", "VITSERVE_MODEL": checkpoint}
    served = Cli(["bash", "-e", "-o", "pipefail", "-c", block.commands()], env=env, command=(), session=True)
    try:
        took = served.wait_ready(1500)
        print(f"{block.id}: /ready after {took:.0f} s")
    finally:
        code = stop(served)
    assert code == 0, served.tail()


@pytest.mark.parametrize("block", _params())
def test_doc_block(block: Block, sessions, monkeypatch, tmp_path):
    assert block.marker_error is None, block.marker_error
    if "no-run" in block.tags:
        pytest.skip(f"no-run: {block.reason}")
    if "server" in block.tags:
        run_server_block(block, tmp_path, sessions(block.doc).env["VITSERVE_MODEL"])
    elif block.is_python:
        run_python(block, sessions(block.doc), monkeypatch)
    else:
        run_shell(block, sessions(block.doc))
