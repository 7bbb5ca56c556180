"""README.md and docs/*.md name only code that exists, and docs/design.md draws the layers lint-imports checks.

tests/unit/test_docs.py checks the files and flags the docs name; this module checks the code names:

- every `vitserve.x.y` (a module, or a name in one) anywhere in the text imports and resolves;
- every name in backticks that looks like code is defined in the repository's Python (vitserve/, tests/,
  bench/, scripts/, docker/): `Class.member` (the class and that member: a method, field or attribute,
  inherited ones included), `module.name` for a vitserve module (`preflight.check`, or a member of a class
  the module defines: `engine.failed`), `name()` for a function, and a CamelCase name (`GroupFeed`); a
  third-party name is in THIRD_PARTY with the module that defines it (checked by importing it), a name that
  is not Python is in NOT_CODE with what it is;
- docs/design.md's "Package layers" table lists, in order, the layers of the import-linter contract in
  pyproject.toml, and its engine row the engine contract's order; each contract's name says the same order.
Lower-case words and dotted names that start with a variable (`timing_ms.decode`, `stream.frames`) are prose
or JSON paths: not checked.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from tests.docblocks import ROOT, doc_files

CODE_DIRS = ("vitserve", "tests", "bench", "scripts", "docker")
# Third-party names the docs use, each with the module that defines it (the test imports it to check).
THIRD_PARTY = {
    "AutoVideoProcessor": "transformers",
    "Qwen2VLImageProcessor": "transformers",
    "Qwen2VLImageProcessorPil": "transformers",
    "GotOcr2ImageProcessor": "transformers",
    "GotOcr2ImageProcessorPil": "transformers",
    "BatchSpanProcessor": "opentelemetry.sdk.trace.export",
    "FileStore": "torch.distributed",
    "TCPStore": "torch.distributed",
    "Image": "PIL.Image.Image",
    "asyncio": "asyncio",
    "hmac": "hmac",
    "torch": "torch",
    "getppid": "os",
    "mkdtemp": "tempfile",
    "smart_resize": "transformers.models.qwen2_vl.image_processing_qwen2_vl",
    "get_image_features": "transformers.Qwen2VLModel",
    "save_pretrained": "transformers.PreTrainedModel",
    "max_memory_reserved": "torch.cuda",
    "empty_cache": "torch.cuda",
}
# Names that look like code but are not Python: what each is.
NOT_CODE = {
    "VmHWM": "the peak resident set field of /proc/<pid>/status",
}
_DOTTED_MODULE = re.compile(r"(?<![\w./-])vitserve(?:\.[a-z_][a-z0-9_]*)+(?:\.[A-Za-z_]\w*)*")
_SPAN = re.compile(r"`([^`\n]+)`")
_CODE_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?")
_FILE = re.compile(r"\.(py|json|md|toml|ya?ml|txt|sh|env|pth)$")  # a file name: tests/unit/test_docs.py
_CAMEL = re.compile(r"[A-Z][A-Za-z0-9]*")


class CodeIndex:
    """What the repository's Python defines, read from its source (no imports)."""

    def __init__(self) -> None:
        self.names: set[str] = set()  # every class, function, module-level or class-level name
        self.functions: set[str] = set()
        self.members: defaultdict[str, set[str]] = defaultdict(set)  # class -> its own members
        self.bases: defaultdict[str, set[str]] = defaultdict(set)  # class -> its bases' names
        self.module_names: defaultdict[str, set[str]] = defaultdict(set)  # vitserve module stem -> top-level
        self.strings: set[str] = set()  # string constants in vitserve/ (span attributes, header names)
        for folder in CODE_DIRS:
            for path in sorted((ROOT / folder).rglob("*.py")):
                self._read(path)

    def _read(self, path: Path) -> None:
        tree = ast.parse(path.read_text())
        in_package = path.relative_to(ROOT).parts[0] == "vitserve"
        for node in tree.body:
            for name in _bound(node):
                self.names.add(name)
                if in_package:
                    self.module_names[path.stem].add(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.add(node.name)
                self.names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                self._read_class(node)
            elif in_package and isinstance(node, ast.Constant) and isinstance(node.value, str):
                self.strings.add(node.value)

    def _read_class(self, node: ast.ClassDef) -> None:
        self.names.add(node.name)
        self.bases[node.name] |= {b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases}
        for item in node.body:
            self.members[node.name] |= set(_bound(item))
        for sub in ast.walk(node):  # self.x = ... in its methods
            stored = isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
            if stored and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                self.members[node.name].add(sub.attr)

    def has_member(self, cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        if member in self.members[cls]:
            return True
        return any(self.has_member(base, member, seen | {cls}) for base in self.bases[cls] - seen - {cls})


def _bound(node: ast.stmt) -> list[str]:
    """The names a top-level (or class-level) statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.ImportFrom | ast.Import):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    if isinstance(node, ast.If | ast.Try):
        return [
            name for sub in ast.iter_child_nodes(node) if isinstance(sub, ast.stmt) for name in _bound(sub)
        ]
    return []


@functools.cache
def index() -> CodeIndex:
    return CodeIndex()


_MISSING = object()


def resolve(dotted: str) -> object:
    """The object `a.b.c` names: the longest importable module prefix, then attributes; _MISSING if none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                break
        return obj
    return _MISSING


def missing_module_names(text: str) -> list[str]:
    named = {m.group(0) for m in _DOTTED_MODULE.finditer(text)}
    return sorted(n for n in named if n not in index().strings and resolve(n) is _MISSING)


def _third_party_has(first: str, rest: list[str]) -> bool:
    where = THIRD_PARTY[first]
    path = where if where.rsplit(".", 1)[-1] == first else f"{where}.{first}"
    return resolve(".".join([path, *rest])) is not _MISSING


def missing_code_name(span: str) -> bool:
    """True when `span` looks like code and is not found (see the module docstring for what looks like code)."""
    if not _CODE_NAME.fullmatch(span) or span.isupper() or span.startswith("vitserve.") or _FILE.search(span):
        return False  # not a name; an ALL_CAPS constant or variable; vitserve.x: missing_module_names
    code = index()
    call = span.endswith("()")
    first, *rest = span.removesuffix("()").split(".")
    if first in NOT_CODE:
        return False
    if first in THIRD_PARTY:
        return not _third_party_has(first, rest)
    if rest:
        if first in code.members or first[0].isupper():
            return not (first in code.members and code.has_member(first, rest[0]))
        if first in code.module_names:  # a module's name, or a member of a class it defines (`engine.failed`)
            defined = code.module_names[first]
            return rest[0] not in defined and not any(
                code.has_member(cls, rest[0]) for cls in defined if cls in code.members
            )
        return False  # a variable or a JSON path
    if call:
        return first not in code.functions
    camel = _CAMEL.fullmatch(first) and sum(c.isupper() for c in first) >= 2 and not first.isupper()
    return bool(camel) and first not in code.names and first not in code.strings


def missing_names(text: str) -> list[str]:
    prose = re.sub(r"^ {0,3}(```|~~~).*?^ {0,3}\1", "", text, flags=re.S | re.M)
    spans = {m.group(1).strip() for m in _SPAN.finditer(prose)}
    return sorted(s for s in spans if missing_code_name(s))


DOCS = doc_files()


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_vitserve_module_named_exists(doc):
    assert missing_module_names(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_code_name_in_backticks_exists(doc):
    assert missing_names(doc.read_text()) == []


def test_the_third_party_names_are_where_they_are_said_to_be():
    assert [name for name in THIRD_PARTY if not _third_party_has(name, [])] == []


# --- docs/design.md's layers against pyproject.toml's import-linter contracts -----------------------------


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _contract_layers(contract: dict) -> list[set[str]]:
    prefix = "" if "containers" in contract else "vitserve."
    return [
        {m.strip().removeprefix(prefix) for m in re.split(r"[|:]", layer)} for layer in contract["layers"]
    ]


def _module(cell: str) -> str:
    """`cli.py` -> cli, `api/` -> api."""
    return cell.strip().strip("`").removesuffix(".py").removesuffix("/")


def design_layers(text: str) -> list[set[str]]:
    """The package layers, top first, from the "Package layers" table's second column: the names in backticks,
    `a` > `b` two layers, `a` \\| `b` and `a`, `b` one; a parenthesis describes, it names no layer."""
    section = text.split("## Package layers", 1)[1].split("\n## ", 1)[0]
    layers: list[set[str]] = []
    for line in section.splitlines():
        if re.match(r"\| \d\w* \|", line):
            cell = re.sub(r"\([^)]*\)", "", re.split(r"(?<!\\)\|", line)[2])
            layers += [{_module(m) for m in re.findall(r"`([^`]+)`", layer)} for layer in cell.split(">")]
    return layers


def design_engine_order(text: str) -> list[set[str]]:
    """The engine's inner order from the table: `a` \\| `b` > `c` > ... after "imports run one way"."""
    match = re.search(r"imports run one way, ((?:`\w+`(?: \\\| | > )?)+)", text)
    assert match, "docs/design.md says how the engine's modules import ('imports run one way, `a` > `b` ...')"
    return [{_module(m) for m in layer.split("\\|")} for layer in match.group(1).split(">")]


def _named_order(name: str) -> list[set[str]]:
    order = name.split(":", 1)[1]
    return [{m.strip() for m in re.split(r"[|,]", layer)} for layer in order.split(">")]


def test_design_md_draws_the_layers_lint_imports_checks():
    text = (ROOT / "docs" / "design.md").read_text()
    package, engine = _contracts()[0], _contracts()[1]
    assert design_layers(text) == _contract_layers(package)
    assert design_engine_order(text) == _contract_layers(engine)


def test_each_layers_contract_is_named_for_its_order():
    for contract in _contracts():
        if contract["type"] == "layers":
            assert _named_order(contract["name"]) == _contract_layers(contract), contract["name"]


# --- the checks themselves can fail --------------------------------------------------------------------------


def test_the_checks_catch_names_that_are_gone():
    assert missing_module_names(
        "see vitserve.engine.engine and vitserve.engine.nowhere, `vitserve.cli.main`"
    ) == ["vitserve.engine.nowhere"]
    text = (
        "`Engine.admit` `Engine._nothing` `NoSuchClass.x` `preflight.check` `preflight.gone` `GroupFeed` "
        "`GroupFeedGone` `build_config()` `no_such_function()` `timing_ms.decode` `VITSERVE_PORT` "
        "`Qwen2VLImageProcessor` `Image.draft` `Image.no_such_thing` `VmHWM`"
    )
    assert missing_names(text) == sorted(
        [
            "Engine._nothing",
            "NoSuchClass.x",
            "preflight.gone",
            "GroupFeedGone",
            "no_such_function()",
            "Image.no_such_thing",
        ]
    )


def test_the_layer_check_reads_what_design_md_writes():
    row = "| 5 | `cli.py` > `flags.py` | x |\n| 4 | `api/` \\| `engine/`, `client.py` (`a.py`, `b`) | y |\n"
    assert design_layers("## Package layers\n\n" + row) == [{"cli"}, {"flags"}, {"api", "engine", "client"}]
    order = "its imports run one way, `node` \\| `service` > `collect` > `jobs`; then"
    assert design_engine_order(order) == [{"node", "service"}, {"collect"}, {"jobs"}]


# --- docs/design.md's hand-over section against vitserve/handover/ ------------------------------------------


def test_design_md_names_every_module_and_transport_of_the_hand_over():
    from vitserve.handover.transports import TRANSPORTS

    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## The hand-over to the LLM server", 1)[1].split("\n## ", 1)[0]
    modules = sorted(p.name for p in (ROOT / "vitserve" / "handover").glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"handover/{m}`" not in section] == []
    assert [name for name in TRANSPORTS if f"`{name}`" not in section] == []
