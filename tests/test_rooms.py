"""The house (DESIGN §4, STYLE.md): rooms by job, imports that only run down, and no side doors.

Read from the code itself (its syntax tree), as a newcomer would read it:
- the import graph of `llmspans/` has no cycle, and no module imports a room above its own in `LAYERS`, which
  is DESIGN §4's order of rooms made explicit (an offline tool above the runtime it drives, the public face
  above what it exports, a lever above the adapters, the call record above its foundations);
- no module imports or reaches a private name (`_name`) of another room: rooms talk through public names;
- a private name of another library is reached only in `llmspans/_internals.py`, where each reach is written
  with the versions it was checked on (tests/test_internals.py holds them to it).

A room is a top-level module, or a subpackage (`_adapters`, `_hedge`, `load`, `report`, `tools`) as a whole.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmspans"
INTERNALS = "llmspans._internals"
# DESIGN §4's rooms, top first: a room may import its own modules and any room below it, never one above.
LAYERS: list[tuple[str, set[str]]] = [
    ("the command line", {"llmspans.__main__"}),
    ("offline tools: load, the simulator and demos", {"llmspans.load", "llmspans.tools"}),
    ("the report, an offline tool the runtime never imports", {"llmspans.report"}),
    ("the public face", {"llmspans", "llmspans.instrumentation", "llmspans.testing"}),
    ("instrumentation of clients and classes", {"llmspans._instrument", "llmspans._classes"}),
    ("levers above the adapters: the hedge", {"llmspans._hedge"}),
    ("set-up, export, tail sampling", {"llmspans._setup", "llmspans._exporters", "llmspans._tail_sampling"}),
    ("client adapters, vLLM's server state", {"llmspans._adapters", "llmspans.vllm"}),
    ("what instrument() was asked for", {"llmspans._settings"}),
    ("the stream interceptor", {"llmspans._stream"}),
    ("the transport layer", {"llmspans._transport", "llmspans._retries"}),
    ("levers on the call: the prompt cap, the caches", {"llmspans._prompt", "llmspans._cache"}),
    ("the call record", {"llmspans._call", "llmspans._phases"}),
    ("stages and turns", {"llmspans._stages"}),
    ("telemetry: providers, metrics, aggregation", {"llmspans._telemetry", "llmspans._metrics", "llmspans._aggregation"}),
    ("held spans: what the SDK would make, made when kept", {"llmspans._held_span"}),
    ("budgets and the limiter", {"llmspans._budget", "llmspans._limiter"}),
    ("the wire format, content", {"llmspans._openai_wire", "llmspans._content", "llmspans._conversation", "llmspans._sse"}),
    (
        "foundations",
        {
            "llmspans._names", "llmspans._sites", "llmspans._guard", "llmspans._deferred", "llmspans._gaps",
            "llmspans._suppress", "llmspans._redact", "llmspans._version", "llmspans._openinference", INTERNALS,
        },
    ),
]  # fmt: skip
# Private by convention, public by contract: a namedtuple's own API.
PUBLIC_UNDERSCORED = {"_asdict", "_fields", "_make", "_replace", "_field_defaults"}


def _name_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, ast.Module]:
    return {_name_of(path): ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`: imports for annotations, never run."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for inner in ast.walk(node))
    return skipped


def _resolve(module: str, node: ast.ImportFrom) -> str:
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if not modules()[module].body or module not in _packages():
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return base


@cache
def _packages() -> set[str]:
    return {_name_of(path) for path in PACKAGE.rglob("__init__.py")}


@cache
def imports() -> tuple[tuple[str, str, ast.AST, str | None], ...]:
    """(importer, imported llmspans module or other library, the node, the name imported from it) of every import
    that runs."""
    return tuple(_imports())


def _imports() -> Iterator[tuple[str, str, ast.AST, str | None]]:
    known = modules()
    for module, tree in known.items():
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield module, alias.name, node, None
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    yield module, full if full in known else base, node, None if full in known else alias.name


def _llmspans_target(name: str) -> str | None:
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def test_the_import_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for importer, imported, _, _ in imports():
        target = _llmspans_target(imported) if imported.startswith("llmspans") else None
        if target is not None and target != importer:
            graph[importer].add(target)
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in sorted(graph[module]):
            if seen.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in seen:
                visit(target, [*path, target])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_every_room_has_a_place_in_design_s_order() -> None:
    placed = [room for _, rooms in LAYERS for room in rooms]
    assert len(placed) == len(set(placed)), "a room placed twice in LAYERS"
    assert {room_of(module) for module in modules()} == set(placed), (
        "a room missing from (or gone from) LAYERS"
    )


def test_no_module_imports_a_room_above_its_own() -> None:
    layer = {room: index for index, (_, rooms) in enumerate(LAYERS) for room in rooms}
    upward = set()
    for importer, imported, node, _ in imports():
        target = _llmspans_target(imported) if imported.startswith("llmspans") else None
        if target is None:
            continue
        here, there = room_of(importer), room_of(target)
        if here != there and layer[there] < layer[here]:
            upward.add(
                f"{importer}:{node.lineno} imports {target} ({LAYERS[layer[there]][0]}, above {LAYERS[layer[here]][0]})"
            )
    assert sorted(upward) == []


@cache
def defined() -> dict[str, set[str]]:
    """The names each room defines itself: its functions, classes, module names, parameters, `self.`/`cls.`
    attributes and slots. A private name outside its room's set belongs to another room or another library."""
    by_room: dict[str, set[str]] = defaultdict(set)
    for module, tree in modules().items():
        found = by_room[room_of(module)]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
            elif (
                isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):  # fmt: skip
                found.add(node.attr)
            elif isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__slots__" for target in node.targets
            ):
                found.update(
                    c.value
                    for c in ast.walk(node.value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
            elif isinstance(node, ast.alias) and node.asname is None and "." not in node.name:
                found.add(node.name)
    return by_room


def side_doors() -> list[str]:
    """Every private name a module imports or reaches that is not its own room's."""
    found: list[str] = []
    by_module: dict[str, list[tuple[str, ast.AST, str | None]]] = defaultdict(list)
    for importer, imported, node, name in imports():
        by_module[importer].append((imported, node, name))
    for module, tree in modules().items():
        room = room_of(module)
        if module == INTERNALS:
            continue
        own = defined()[room]
        bound: dict[str, str] = {}  # a local name -> the module it names
        for imported, node, name in by_module[module]:
            for alias in node.names:  # type: ignore[attr-defined]
                local = alias.asname or alias.name.split(".")[0]
                bound[local] = imported if name is None else f"{imported}.{name}"
            if not imported.startswith("llmspans") and any(map(_private, imported.split("."))):
                found.append(f"{module}:{node.lineno} imports from {imported}")  # a library's private module
            elif name is not None and _private(name):
                ours = imported.startswith("llmspans")
                if not ours or room_of(_llmspans_target(imported) or imported) != room:
                    found.append(f"{module}:{node.lineno} imports {name} from {imported}")
        for node in ast.walk(tree):
            private: str | None = None
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and node.attr not in PUBLIC_UNDERSCORED
            ):
                private, value = node.attr, node.value
                if isinstance(value, ast.Name) and value.id in bound:
                    target = bound[value.id]
                    if (
                        not target.startswith("llmspans")
                        or room_of(_llmspans_target(target) or target) != room
                    ):
                        found.append(f"{module}:{node.lineno} reaches {ast.unparse(node)}")
                    continue
            elif (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
            ):  # fmt: skip
                private = node.args[1].value
            if private is not None and private not in own:
                found.append(
                    f"{module}:{node.lineno} reaches {private} (not {room}'s own: another room's or library's)"
                )
    return found


def test_no_module_reaches_a_private_name_of_another_room_or_library() -> None:
    assert side_doors() == []


def test_the_hedge_walks_no_frames_and_reassigns_no_class() -> None:
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        assert "_current_frames" not in source, path
        assert "__class__ =" not in source, path
