"""README.md and docs/*.md name only things that exist: files in this repository, and flags vitserve has.

- Every relative Markdown link resolves from the linking file (as GitHub resolves it).
- Every `*.md` / `*.py` path named in the text exists: at the repository root, next to the document, or as
  the tail of a file in the tree (`processors/budget.py` for vitserve/processors/budget.py); a glob such
  as `test_faults*.py` must match at least one file.
- No document cites the design notes that live outside the repository (SPEC, DESIGN, INTERFACES,
  RELIABILITY).
- Every `--flag` is a flag of `vitserve` (vitserve.flags.FLAGS, its dashed alias, `--no-` for a switch, or
  `--help`), or is in NON_VITSERVE_FLAGS below with the program it belongs to.
- Every doc-test marker before a code block is understood and carries its reason (see
  tests/integration/test_doc_blocks.py for the convention).
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

from tests.docblocks import ROOT, blocks, doc_files, flags, links, named_paths
from vitserve.flags import FLAGS
from vitserve.flags.spec import parse_bool

# Flags the docs mention that belong to another program; each says whose it is.
NON_VITSERVE_FLAGS = {
    "bind": "python -m vitserve.rpc.receiver --bind ENDPOINT (the stand-in LLM side)",
    "check": "ruff format --check (scripts/lint.sh)",
    "quick": "bash scripts/test.sh --quick, the quick tier (README, Development)",
    "env-file": "docker compose --env-file docker/versions.env (docs/deploy.md)",
    "build": "docker compose up --build (docs/deploy.md)",
    "nproc_per_node": "torchrun --nproc_per_node 1 (docs/engine.md, Nodes)",
    "from-literal": "kubectl create secret generic --from-literal (docs/scaling.md)",
    "max_restarts": "torchrun --max_restarts (docs/engine.md, Nodes)",
    "enable-mm-embeds": "vllm serve --enable-mm-embeds (docs/vllm.md)",
    "limit-mm-per-prompt": "vllm serve --limit-mm-per-prompt (docs/vllm.md)",
    "media-io-kwargs": "vllm serve --media-io-kwargs (docs/vllm.md, Video)",
    "trust-request-mm-kwargs": "vllm serve --trust-request-mm-kwargs (docs/vllm.md, Video)",
    "gpu-memory-utilization": "vllm serve --gpu-memory-utilization (docs/vllm.md)",
    "ec-transfer-config": "vllm serve --ec-transfer-config (docs/vllm.md, The encoder-cache hand-over)",
    "no-deps": "pip install --no-deps /path/to/vitserve (docs/vllm.md, vitserve's vLLM connector)",
    "wheel-dir": "pip wheel --wheel-dir dist (docs/vllm.md, vitserve's vLLM connector)",
    "shm-size": "docker run --shm-size (docs/vllm.md, The wire hand-over, Containers)",
    "ipc": "docker run --ipc=host (docs/vllm.md and docs/wire.md, one write on one host)",
    "data-parallel-size": "vllm serve --data-parallel-size (docs/vllm.md, Pull)",
    "sittings": "python bench/reservation.py --sittings (docs/engine.md, a budget from memory)",
    "load": "python bench/reservation.py --load (docs/engine.md, a budget from memory)",
}
OUTSIDE_NOTES = re.compile(r"\b(SPEC|DESIGN|INTERFACES|RELIABILITY)\b")
# The outside notes' scenario IDs ("scenario L3", test_f5_..., "(B10)"): cite docs/design.md's invariants instead.
SCENARIO_IDS = re.compile(r"\b[Ss]cenarios? [LFBS]\d|\btest_[lfbs]\d+_|\([LFBS]\d+\)")
DOCS = doc_files()


def _tree() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.splitlines()


def vitserve_flags() -> set[str]:
    known = {"help", "version"}
    for flag, spec in FLAGS.items():
        known |= {flag, flag.replace("_", "-")}
        if spec.parse is parse_bool:
            known |= {f"no-{flag}", f"no-{flag.replace('_', '-')}"}
    return known


def missing_paths(doc: Path, text: str, tree: list[str]) -> list[str]:
    missing = []
    for target in links(text):
        if not (doc.parent / target).exists():
            missing.append(f"link {target}")
    for name in named_paths(text):
        if (ROOT / name).exists() or (doc.parent / name).exists():
            continue
        if not any(fnmatch.fnmatch(path, name) or fnmatch.fnmatch(path, "*/" + name) for path in tree):
            missing.append(name)
    return missing


@pytest.fixture(scope="module")
def tree() -> list[str]:
    return _tree()


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_named_files_exist(doc, tree):
    assert missing_paths(doc, doc.read_text(), tree) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_no_reference_to_notes_outside_the_repository(doc):
    hits = [
        f"{n}: {line.strip()}"
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if OUTSIDE_NOTES.search(line)
    ]
    assert hits == []


def test_no_scenario_ids_of_the_outside_notes(tree):
    """Code, tests and docs (not the dated bench/history/ records) name invariants, not the notes' scenarios."""
    hits = [
        f"{path}:{n}: {line.strip()}"
        for path in tree
        if path.endswith((".py", ".md", ".toml"))
        and not path.startswith("bench/history/")
        and path != "tests/unit/test_docs.py"  # its own examples
        for n, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if SCENARIO_IDS.search(line)
    ]
    assert hits == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_flag_exists(doc):
    known = vitserve_flags() | set(NON_VITSERVE_FLAGS)
    assert sorted({f"--{f}" for f in flags(doc.read_text()) if f not in known}) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_doc_test_markers_are_understood(doc):
    assert [f"{b.id}: {b.marker_error}" for b in blocks(doc) if b.marker_error] == []


# The checks themselves can fail: each meets the mistake it is there to catch.


def test_checks_catch_missing_files_and_links(tree):
    doc = ROOT / "docs" / "x.md"
    text = (
        "See [api](api.md), [gone](nowhere.md), `vitserve/engine/engine.py`, `processors/budget.py`, "
        "`tests/integration/test_faults*.py`, `SPEC.md` and `vitserve/nothing.py`."
    )
    assert missing_paths(doc, text, tree) == ["link nowhere.md", "SPEC.md", "vitserve/nothing.py"]


def test_scenario_check_catches_the_notes_ids():
    for text in (
        "fill the budget (scenario L3)",
        "def test_f5_workers_exit():",
        "exits with the parent (F5).",
    ):
        assert SCENARIO_IDS.search(text), text
    assert not SCENARIO_IDS.search("a 256-entry table stays in L1 (docs/design.md invariant 7)")


def test_flag_check_knows_aliases_and_switches():
    known = vitserve_flags()
    assert {"visual_batch_max_tokens", "visual-batch-max-tokens", "no-jpeg_draft", "help"} <= known
    assert "master_rank" not in known  # --node_rank is the flag; torchrun has no --master_rank either
    assert "no-port" not in known  # only switches have a --no- form
    assert flags("run `vitserve --port 1 --no-jpeg_draft`, not --master_rank; a -- b") == [
        "port",
        "no-jpeg_draft",
        "master_rank",
    ]


def test_marker_parser_wants_a_reason():
    text = (
        "<!-- no-run: needs vLLM -->\n```python\nimport vllm\n```\n"
        "<!-- no-run -->\n```bash\nfalse\n```\n"
        "<!-- slow server: the demo at 8192 takes minutes -->\n```bash\nvitserve\n```\n"
        "<!-- skip: whatever -->\n```sh\ntrue\n```\n"
        "```json\n{}\n```\n"
        "```console\n$ echo hi \\\n  there\nhi there\n```\n"
    )
    found = blocks(ROOT / "docs" / "x.md", text)
    assert [(b.lang, sorted(b.tags), b.reason) for b in found] == [
        ("python", ["no-run"], "needs vLLM"),
        ("bash", ["no-run"], ""),
        ("bash", ["server", "slow"], "the demo at 8192 takes minutes"),
        ("sh", ["skip"], "whatever"),
        ("console", [], ""),
    ]
    assert [b.marker_error is None for b in found] == [True, False, True, False, True]
    assert found[4].commands() == "echo hi \\\n  there\n"
    assert found[0].line == 3
