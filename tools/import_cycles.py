"""Import circles inside each package of pagedllm, lazy (function-level) imports included.

import-linter checks the layers between packages; this counts every `import` statement the
`ast` module finds in a module's source, wherever it stands (top level, a function, a branch),
and reports each strongly connected group of two or more modules of one package that import
one another. Exit status 1 when there is a circle.

    python tools/import_cycles.py [root]   (root: the pagedllm folder; default: this tree's)
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(name: str, path: Path, is_pkg: bool, known: set[str]) -> set[str]:
    """The modules of the project `path` imports (a `from x import y` names x.y when y is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[: len(base) - node.level + 1]
                mod = ".".join(up + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def circles(root: Path) -> list[list[str]]:
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        for t in imports_of(name, path, path.name == "__init__.py", known):
            if _package(name) == _package(t):  # inside one top-level package, its subpackages included
                graph[name].add(t)
    return [c for c in _sccs(known, graph) if len(c) > 1]


def _package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def _sccs(nodes: set[str], graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return sorted(out)


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "pagedllm"
    found = circles(root.resolve())
    n = sum(1 for _ in root.rglob("*.py"))
    for c in found:
        print("circle among:", ", ".join(c))
    print(f"{n} modules, {len(found)} circle(s) inside a package")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
