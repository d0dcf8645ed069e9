"""Reading inductor's generated code: which Triton kernels only move data.

``torch._inductor.utils.run_and_get_code`` returns the Python modules inductor generated for a compiled
call; each Triton kernel is a ``@triton.jit`` function inside them. A pointwise kernel *moves data* when every
value it stores is a loaded value, at most converted (``.to``), selected (``tl.where`` on an index
condition) or replaced by a constant: a copy, a layout change, a scatter into a view, or a load and store
back to the same address. A kernel that computes anything from a loaded value (an add, a norm, GELU)
does work and is not counted.
"""
from __future__ import annotations

import ast
import re
import textwrap

_KERNEL_SOURCE = re.compile(r"async_compile\.triton\(\s*'(\w+)',\s*'''(.*?)'''", re.S)


def triton_kernels(sources: list[str]) -> dict[str, str]:
    """{kernel name: kernel source} of the Triton kernels in inductor's generated modules."""
    kernels = {}
    for source in sources:
        for name, body in _KERNEL_SOURCE.findall(source):
            kernels[name] = textwrap.dedent(body)
    return kernels


def _kernel_def(source: str, name: str) -> ast.FunctionDef | None:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _is_call(node: ast.AST, dotted: str) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) == dotted


def _moves_only(value: ast.AST, data: set[str]) -> bool:
    """True if `value` passes loaded data through without computing on it."""
    if isinstance(value, ast.Name) or isinstance(value, ast.Constant):
        return True
    if _is_call(value, "tl.load") or _is_call(value, "tl.full"):
        return True
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "to":
        return _moves_only(value.func.value, data)  # dtype conversion of a moved value
    if _is_call(value, "tl.where"):  # select between values on a condition that uses no loaded data
        cond, *choices = value.args
        return not (_names(cond) & data) and all(_moves_only(c, data) for c in choices)
    if isinstance(value, ast.Subscript):  # broadcasting, e.g. tmp0[None, :]
        return _moves_only(value.value, data)
    # index arithmetic on non-data values is fine; anything applied to loaded data is work
    return not (_names(value) & data)


def moves_only_data(source: str, name: str) -> bool:
    """True if pointwise kernel `name` in `source` stores only loaded values (see the module docstring)."""
    fn = _kernel_def(source, name)
    if fn is None or not name.startswith("triton_poi"):
        return False
    data: set[str] = set()
    for stmt in ast.walk(fn):
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = stmt.value
            loads = any(_is_call(n, "tl.load") for n in ast.walk(value))
            if loads or (_names(value) & data):
                if not _moves_only(value, data):
                    return False
                data.add(stmt.targets[0].id)
    return bool(data)


def numel(source: str) -> int | None:
    """The kernel's element count where inductor wrote it as a constant (static shapes)."""
    found = re.search(r"^\s*xnumel = (\d+)\s*$", source, re.M)
    return int(found.group(1)) if found else None


def data_moving_kernels(sources: list[str], min_numel: int) -> dict[str, int]:
    """{name: numel} of pointwise kernels that only move data over at least `min_numel` elements."""
    found = {}
    for name, source in triton_kernels(sources).items():
        n = numel(source)
        if n is not None and n >= min_numel and moves_only_data(source, name):
            found[name] = n
    return found
