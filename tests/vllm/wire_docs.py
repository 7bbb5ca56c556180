"""The commands of docs/vllm.md for --llm_transport wire, read from the document itself (tests/docblocks.py) so
that tests run what a reader copies, with only its placeholders substituted: the install (vitserve's
connector section), the key, vLLM, vitserve and the comparison ("The wire hand-over", "Start it"), and the two
hosts' commands ("Two hosts"). tests/vllm/test_wire.py runs them against its connector vLLM;
tests/unit/test_wire_transport.py parses the two hosts' vitserve flags.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass

from tests.docblocks import ROOT, Block, blocks

DOC = ROOT / "docs" / "vllm.md"
# The placeholders of the documented commands (what the tests substitute).
MODEL = "/models/Qwen2.5-VL-7B-Instruct"
VLLM_URL = "http://127.0.0.1:8000"
VITSERVE_URL = "http://127.0.0.1:8100"
ENDPOINT = "tcp://127.0.0.1:5600"
KEY_FILE = "vitserve-wire.key"
CHECKOUT = "/path/to/vitserve"
VLLM_MODULE = ["python", "-m", "vllm.entrypoints.openai.api_server"]


@dataclass(frozen=True)
class StartIt:
    """The blocks of "Start it", in the document's order."""

    key: Block
    vllm: Block
    vitserve: Block
    compare: Block


def section(heading: str) -> list[Block]:
    """The shell and Python blocks between `heading` (a whole line) and the next heading of its level or above."""
    text = DOC.read_text()
    lines = text.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = next(
        (i for i in range(start + 1, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines)
    )
    return [b for b in blocks(DOC, text) if start < b.line - 1 <= end]


def start_it() -> StartIt:
    key, vllm, vitserve, compare = section("### Start it")
    return StartIt(key, vllm, vitserve, compare)


def code(block: Block) -> str:
    """The block's code as a reader pastes it (blocks in list items are indented)."""
    return textwrap.dedent(block.commands())


def commands(block: Block) -> list[list[str]]:
    """Each shell command of a block as argv (continuations joined, comments dropped)."""
    joined = code(block).replace("\\\n", " ")
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def substituted(argv: list[str], values: Mapping[str, str]) -> list[str]:
    return [values.get(arg, arg) for arg in argv]


def options(argv: list[str]) -> dict[str, str | bool]:
    """`--flag value` / `--switch` / `-O0` pairs of a command line (no positional arguments)."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        name = argv[i]
        assert name.startswith("-"), f"a positional argument {name!r} in {argv}"
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("-")
        out[name.lstrip("-")] = argv[i + 1] if takes_value else True
        i += 2 if takes_value else 1
    return out


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def install_targets() -> list[tuple[str, str]]:
    """(pip subcommand, what it installs or builds) for every pip command of the connector's install blocks."""
    found = []
    for block in section("## vitserve's vLLM connector (`vitserve.vllm_connector`)"):
        for argv in commands(block):
            if argv[0] == "pip":
                assert "--no-deps" in argv, f"{argv}: vLLM's own packages must not change"
                found.append((argv[1], argv[-1]))
    return found


def ec_transfer_config(value: str | bool) -> dict:
    assert isinstance(value, str), value
    return json.loads(value)
