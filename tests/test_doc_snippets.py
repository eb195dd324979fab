"""The Python snippets of README.md and docs/ name what exists: every ``megatron_mesh`` module,
function and class they import or reach through ``mm.``, every keyword they pass to one of them,
and every name they use is imported or defined in the snippet -- or is one of the placeholders
the prose around them stands for (the caller's tensors and process group, :data:`PLACEHOLDERS`).

Why: a snippet is what a user copies first. Three of them had gone stale without a test noticing
(stop 79): ``forward_backward`` imported from a module that no longer had it, a config keyword
the class never took (``mesh_tile_shape=`` instead of ``cp_settings=PluginSettings.of(...)``),
and a custom mask kind without its imports. They are checked here without running them (most
need a CP group or a GPU); the commands the docs quote are run by tests/tools/test_scripts.py.
"""

from __future__ import annotations

import ast
import builtins
import glob
import importlib
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what the prose around a snippet says the reader brings: this rank's tensors (q, k, v in Megatron's
# [s, b, h, d] layout, ``v_128`` an MLA value, ``dout`` a gradient, ``sink_logits`` a sink
# parameter), the CP group, the sequence length, the CP size, document boundaries, a rank, a
# full-sequence tensor ``Q`` and TE's padded boundaries
PLACEHOLDERS = {"q", "k", "v", "v_128", "dout", "sink_logits", "cp_group", "cp", "S", "P", "cu", "rank", "Q",
                "cu_seqlens_padded", "seq_lens", "my_chunks"}


def snippets() -> list[tuple[str, int, str]]:
    """(file, first line, code) of every ```python block of README.md and docs/**/*.md."""
    out = []
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                 recursive=True))
    for path in files:
        text = open(path).read()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            out.append((os.path.relpath(path, ROOT), text[:m.start()].count("\n") + 2, m.group(1)))
    return out


SNIPPETS = snippets()


def test_the_docs_have_python_snippets():
    # the regex finds them (a change of fence style would make every test below vacuous)
    assert len(SNIPPETS) >= 7, SNIPPETS


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the snippet binds: imports, assignments, loop and with targets, defs, classes and
    their arguments (a snippet is short: one scope is close enough)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound


def _resolve(tree: ast.AST) -> dict[str, object]:
    """Snippet name -> the object it is bound to by an import of megatron_mesh (others: skipped)."""
    names: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "megatron_mesh":
                    mod = importlib.import_module(a.name)
                    names[a.asname or a.name] = mod if a.asname else importlib.import_module("megatron_mesh")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron_mesh":
            mod = importlib.import_module(node.module)
            for a in node.names:
                if not hasattr(mod, a.name) and hasattr(mod, "__path__"):  # a submodule its package does not import
                    importlib.import_module(f"{node.module}.{a.name}")
                assert hasattr(mod, a.name), f"from {node.module} import {a.name}: {node.module} has no {a.name}"
                names[a.asname or a.name] = getattr(mod, a.name)
    return names


def _target(node: ast.AST, names: dict[str, object]):
    """The object an expression ``a.b.c`` stands for, where ``a`` is a resolved name; else None.
    An attribute that does not exist fails the test, naming it."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    obj, path = names[node.id], node.id
    for attr in reversed(parts):
        if not hasattr(obj, attr) and inspect.ismodule(obj):
            try:
                importlib.import_module(f"{obj.__name__}.{attr}")
            except ImportError:
                pass
        assert hasattr(obj, attr), f"{path}.{attr} does not exist"
        obj, path = getattr(obj, attr), f"{path}.{attr}"
    return obj


@pytest.mark.parametrize("where,line,code", SNIPPETS, ids=[f"{f}:{n}" for f, n, _ in SNIPPETS])
def test_snippet_names_exist_and_keywords_are_taken(where, line, code):
    tree = ast.parse(code, filename=where)  # a SyntaxError names the file
    names = _resolve(tree)
    # every name used is bound in the snippet, a builtin or a placeholder of the prose
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    unbound = used - _bound_names(tree) - set(dir(builtins)) - PLACEHOLDERS
    assert not unbound, f"{where}:{line}: the snippet uses {sorted(unbound)} without importing or defining them"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            _target(node, names)  # fails on an attribute that does not exist
        if not isinstance(node, ast.Call):
            continue
        fn = _target(node.func, names)
        if fn is None or not callable(fn):
            continue
        params = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        for kw in node.keywords:
            assert kw.arg is None or kw.arg in params, (
                f"{where}:{line}: {ast.unparse(node.func)}() takes no keyword {kw.arg!r} "
                f"(it takes {', '.join(params)})")
