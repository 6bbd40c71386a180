"""The shape of the product code: files over 400 lines, functions over 60 lines, import circles.

Why: issue 35 asks for these figures before and after the seams redesign, and a reviewer
wants them again whenever a module grows. An import circle here is a strongly connected set
of product modules when every import counts, also those written inside a function to keep
Python's top-level import order working (they hide the circle; they do not remove it).
``TYPE_CHECKING`` imports are left out: they never run.

    python bench/code_shape.py            # the report
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "contract/splitserve_contract",
    "operator/splitserve_operator",
    "runtime/splitserve_runtime",
    "planner/splitserve_planner",
    "cli/splitserve_cli",
)
LONG_FILE = 400
LONG_FUNCTION = 60


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        base = ROOT / package
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def graph(found: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in found.items():
        tree = ast.parse(path.read_text())
        targets = set()
        for name in _imports(tree, module, path.name == "__init__.py"):
            while name and name not in found:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):  # not itself, not a parent
                targets.add(name)
        edges[module] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def main() -> None:
    found = modules()
    long_files = sorted(
        ((len(p.read_text().splitlines()), m) for m, p in found.items() if len(p.read_text().splitlines()) > LONG_FILE),
        reverse=True,
    )
    long_functions: list[tuple[int, str]] = []
    for module, path in found.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > LONG_FUNCTION:
                    long_functions.append((length, f"{module}.{node.name}"))
    long_functions.sort(reverse=True)
    cycles = circles(graph(found))
    print(f"modules: {len(found)}")
    print(f"files over {LONG_FILE} lines: {len(long_files)}")
    for lines, module in long_files:
        print(f"  {lines:5d}  {module}")
    print(f"functions over {LONG_FUNCTION} lines: {len(long_functions)}")
    for lines, name in long_functions:
        print(f"  {lines:5d}  {name}")
    print(f"import circles (every import, TYPE_CHECKING aside): {len(cycles)}")
    for component in cycles:
        print(f"  {len(component)} modules: {', '.join(component)}")


if __name__ == "__main__":
    main()
