"""Reading README.md and docs/*.md the way the doc tests need: fenced code blocks with their markers, and the
paths and flags the prose names. Used by tests/unit/test_docs.py and tests/integration/test_doc_blocks.py,
whose docstrings give the conventions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
PYTHON_LANGS = frozenset({"python", "py"})
TAGS = frozenset({"no-run", "slow", "server"})
TAGS_NEEDING_REASON = frozenset({"no-run", "slow"})

_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_COMMENT = re.compile(r"^<!--(?P<body>.*?)-->$")
_MARKER = re.compile(r"^(?P<tags>[a-z-]+(?:[ ,]+[a-z-]+)*)\s*(?::(?P<reason>.*))?$")


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md, whoever wrote them."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the first code line (the one after the opening fence)
    lang: str
    text: str
    tags: frozenset[str]
    reason: str
    marker_error: str | None  # a marker that is not understood or lacks its reason

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.lang in PYTHON_LANGS

    def commands(self) -> str:
        """The code to run: console blocks keep only their `$ ` lines (and continuations), no output."""
        if self.lang != "console":
            return self.text
        out: list[str] = []
        continuing = False
        for line in self.text.splitlines():
            if line.startswith("$ ") or continuing:
                out.append(line[2:] if line.startswith("$ ") and not continuing else line)
                continuing = line.rstrip().endswith("\\")
        return "\n".join(out) + "\n"


def parse_marker(comment: str) -> tuple[frozenset[str], str, str | None]:
    """`no-run: reason`, `slow: reason`, `slow server: reason`, `server` -> (tags, reason, error or None)."""
    m = _MARKER.match(comment.strip())
    if not m:
        return (
            frozenset(),
            "",
            f"unreadable doc-test marker <!--{comment}-->; expected e.g. <!-- no-run: why -->",
        )
    tags = frozenset(re.split(r"[ ,]+", m.group("tags")))
    reason = (m.group("reason") or "").strip()
    if tags - TAGS:
        return tags, reason, f"unknown doc-test marker {sorted(tags - TAGS)} (known: {sorted(TAGS)})"
    if tags & TAGS_NEEDING_REASON and not reason:
        return (
            tags,
            reason,
            f"marker {sorted(tags)} needs a reason after ':' (why can this block not run here?)",
        )
    return tags, reason, None


def blocks(doc: Path, text: str | None = None) -> list[Block]:
    """The shell and Python fenced blocks of one Markdown file, in order, each with its marker (if any)."""
    lines = (doc.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group("fence"), (m.group("info").split() or [""])[0].lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        if lang in SHELL_LANGS | PYTHON_LANGS:
            tags, reason, error = frozenset(), "", None
            comment = _COMMENT.match(lines[i - 1].strip()) if i else None
            if comment:
                tags, reason, error = parse_marker(comment.group("body"))
            code = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Block(doc, i + 2, lang, code, tags, reason, error))
        i = end + 1
    return found


# Markdown links [text](target) and paths named in `code spans` or bare prose.
_LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?:#[^)]*)?\)")
_NAMED_PATH = re.compile(r"(?<![\w./:-])(?P<path>[\w*.-]+(?:/[\w*.-]+)*\.(?:md|py))\b")
_FLAG = re.compile(r"(?<![\w-])--(?P<flag>[A-Za-z][\w-]*)")


def links(text: str) -> list[str]:
    """Relative link targets (no scheme, no pure #anchor)."""
    return [m.group("target") for m in _LINK.finditer(text) if ":" not in m.group("target")]


def named_paths(text: str) -> list[str]:
    """Every `something.md` / `dir/something.py` named in the text (globs like test_faults*.py included)."""
    without_links = _LINK.sub("]()", text)
    without_urls = re.sub(r"\w+://\S+", "", without_links)
    return [m.group("path") for m in _NAMED_PATH.finditer(without_urls)]


def flags(text: str) -> list[str]:
    return [m.group("flag") for m in _FLAG.finditer(text)]
