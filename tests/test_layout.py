"""The package's layering: no import cycle between its modules (imports inside functions included), and
dependencies that run one way: kernels/ below swin.models, swin.data and swin.train; the CLIs on top."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("swin", "kernels")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (`from a import b` counts a.b when b is a
    module, else a)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_graph_sees_the_imports_it_checks():
    graph = _graph()
    assert "swin.models.swin_transformer" in graph["swin.models.registry"]
    assert "kernels.flash_window" in graph["swin.models.attention"]  # an import inside a function
    assert "swin.data.gpu.batch_ring" in graph["swin.data.loaders"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    assert _cycle(_graph()) is None


def test_layers_depend_one_way():
    """kernels/ imports nothing of swin; swin.models nothing of data or train; swin.data nothing of train or models."""
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("kernels"):
            assert not {d for d in deps if d.startswith("swin")}, name
        if name.startswith("swin.models"):
            assert not {d for d in deps if d.startswith(("swin.data", "swin.train", "swin.evaluate"))}, name
        if name.startswith("swin.data"):
            assert not {d for d in deps if d.startswith(("swin.train", "swin.models", "swin.evaluate"))}, name
