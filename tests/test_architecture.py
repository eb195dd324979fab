"""The package's shape, checked: no import cycle (module-level and function-level imports alike),
the layers' dependency direction (plan/ never imports torch, only megatron/ imports Megatron,
nothing below megatron/ imports it)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_mesh")


def _modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> list[str]:
    """Package modules ``name`` imports anywhere in its file (an ``from .x import y`` of a
    submodule y counts as importing y)."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                target = full if full in modules else base
                if target in modules and target != name:
                    out.append(target)
    return out


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert sum(len(v) for v in graph.values()) > 100  # the walk sees the package's imports
    assert _cycles(graph) == []


def test_only_the_adapter_imports_megatron():
    """megatron_mesh/megatron/ is the only package importing Megatron-Core; the plan, runtime,
    comm, kernels and tools layers never do."""
    found = []
    for name, path in _modules().items():
        if name.startswith("megatron_mesh.megatron"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{name}: {m}" for m in mods if m == "megatron" or m.startswith("megatron.")]
    assert not found, found


def test_plan_package_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import megatron_mesh.plan as p, megatron_mesh.tools.planner, megatron_mesh.tools.plan_cli\n"
            "import pkgutil, importlib\n"
            "for m in pkgutil.walk_packages(p.__path__, 'megatron_mesh.plan.'):\n"
            "    importlib.import_module(m.name)\n"
            "assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]\n")
    subprocess.run([sys.executable, "-c", code], check=True)
