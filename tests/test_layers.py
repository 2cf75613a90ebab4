"""The package's layers hold: each imports only the layers below it, and no module cycles.

Every import counts: at module top, inside functions and under ``TYPE_CHECKING`` (the cycles an
``import dflash_server`` never shows hide there). The layer map is docs/development.md's.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dflash_server"

# Lowest first. A module may import its own layer and the ones listed before it.
LAYERS = [
    "models",
    "drafters",
    "adaptive",
    "generation",
    "chat",
    "engine",
    "cli_parser",
    "config_files",
    "settings",
    "models_file",
    "api",
    "serve",
    "tools",
    "cli",
]
# Outside the stack: the package face (the Python API) and the offline model builders.
ABOVE_ALL = {
    "__init__": set(LAYERS) - {"cli"},
    "testing": {"models", "drafters", "adaptive", "generation"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    """Module -> the dflash_server modules it imports (``from x import y`` may name a module)."""
    graph: dict[str, set[str]] = defaultdict(set)
    modules = {_module(p) for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        name = _module(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("dflash_server"):
                    graph[name].add(node.module)
                    graph[name] |= {f"{node.module}.{a.name}" for a in node.names} & modules
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith("dflash_server")}
    return {k: v - {k} for k, v in graph.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for module, targets in _imports().items():
        own = _layer(module)
        allowed = ABOVE_ALL.get(own) or set(LAYERS[: LAYERS.index(own) + 1])
        allowed = allowed | {own}
        upward += [f"{module} -> {t}" for t in sorted(targets) if _layer(t) not in allowed]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = _imports()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo += graph.get(node, ())
        return False

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert not cycles, f"modules that import each other (directly or in a loop): {cycles}"


def test_the_map_names_every_layer() -> None:
    """A new folder must get a place in the layer map (and docs/development.md)."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    files = {p.stem for p in PACKAGE.glob("*.py")}
    assert folders | files <= set(LAYERS) | set(ABOVE_ALL)
