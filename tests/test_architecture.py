"""The package's shape, checked: no import cycle (module-level and function-level imports alike),
the layers' dependency direction (plan/ never imports torch, only megatron/ imports Megatron,
nothing below megatron/ imports it, tools/ sit on plan/ alone), settings read through their typed
object, state held by objects (the module-level state of megatron/ and runtime/, the tests'
patches of package state), no function nothing uses, and the sizes of files, functions and classes."""

from __future__ import annotations

import ast
import functools
import os
import re
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


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` in ``package`` imports from."""
    base = node.module or ""
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return base


def _imports(name: str, path: str, modules: dict[str, str]) -> list[str]:
    """Package modules ``name`` imports anywhere in its file (an ``from .x import y`` of a
    submodule y counts as importing y)."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
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


def test_tools_sit_on_the_plan_layer_only():
    """tools/ (the planner, its CLI, the prediction for a config, the report, the YAML reader) import
    the plan layer and each other, never megatron/, runtime/, comm/ or kernels/ (issue 49: predict.py
    read YAML through megatron/)."""
    found = [f"{name}: {target}" for name, path in _modules().items() if name.startswith("megatron_mesh.tools")
             for target in _imports(name, path, _modules())
             if not target.startswith(("megatron_mesh.plan", "megatron_mesh.tools"))]
    assert not found, found


def _plugin_dests() -> set[str]:
    from megatron_mesh.megatron.settings import flags

    return {f.dest for f in flags()} | {"cp_seq_length", "cp_documents"}  # and the config fields they once had


def test_settings_are_read_through_the_typed_object():
    r"""Outside the settings module nothing reads a plugin flag off Megatron's arguments or a config --
    neither ``getattr(args|config, "<dest>")`` (the issue's grep: ``getattr\((args|config),
    *"(cp_|tasp_|mesh_|log_cp|no_cp)``) nor ``args.<dest>``: they read the typed, frozen
    PluginSettings made from them (issue 49: 24 such reads in 8 files); and the Ulysses degree
    (``--hierarchical-context-parallel-sizes``) is read in one place, plan/megatron_problem.py
    (issue 49: 7 reads in 4 files)."""
    dests, prefix = _plugin_dests(), re.compile(r"(cp_|tasp_|mesh_|log_cp|no_cp)")
    receiver = re.compile(r"(self\.)?(args|config|cfg)")
    raw, ulysses = [], []
    for name, path in _modules().items():
        for node in ast.walk(_tree(path)):
            where = f"{name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                text, key = ast.unparse(node.args[0]), node.args[1].value
                if receiver.fullmatch(text) and prefix.match(str(key)) or key in dests:
                    raw.append(f"{where} {ast.unparse(node)}")
            elif isinstance(node, ast.Attribute) and node.attr in dests and receiver.fullmatch(ast.unparse(node.value)):
                raw.append(f"{where} {ast.unparse(node)}")
            if isinstance(node, ast.Attribute) and node.attr == "hierarchical_context_parallel_sizes" or \
                    isinstance(node, ast.Constant) and node.value == "hierarchical_context_parallel_sizes":
                ulysses.append(where)
    assert [r for r in raw if not r.startswith("megatron_mesh.megatron.settings:")] == [], raw
    assert [u.split(":")[0] for u in ulysses] == ["megatron_mesh.plan.megatron_problem"], ulysses


def test_plan_package_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import megatron_mesh.plan as p, megatron_mesh.tools.planner, megatron_mesh.tools.plan_cli\n"
            "import pkgutil, importlib\n"
            "for m in pkgutil.walk_packages(p.__path__, 'megatron_mesh.plan.'):\n"
            "    importlib.import_module(m.name)\n"
            "assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- state owned by objects, and no dead code ------------------------------------------------------------------
ROOT = os.path.dirname(PACKAGE)


@functools.lru_cache(maxsize=None)
def _tree(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read())

_CONTAINERS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter", "WeakKeyDictionary",
               "WeakValueDictionary", "WeakSet", "Lock", "RLock", "Event", "Condition"}
_MUTATORS = {"append", "add", "clear", "update", "pop", "popitem", "setdefault", "discard", "remove", "extend",
             "insert", "move_to_end", "set", "appendleft"}


def _callee(node) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _module_aliases(tree, package: str) -> dict[str, str]:
    """name -> dotted package path (modules and their members) of every import in ``tree``
    (``package``: the importing module's package, for relative imports), and of plain
    assignments of such a path (``T = telemetry._State``)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    out[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            path = _dotted(node.value, out)
            if path and path.startswith("megatron_mesh."):
                out.setdefault(node.targets[0].id, path)
    return out


def _dotted(node, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _data_names(path: str) -> set[str]:
    """The data (not function or class) bindings of the package module or class at dotted ``path``."""
    modules = _modules()
    owner, body = path, None
    if path in modules:
        body = _tree(modules[path]).body
    elif path.rsplit(".", 1)[0] in modules:
        owner, cls = path.rsplit(".", 1)
        for node in _tree(modules[owner]).body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                body = node.body
    if body is None:
        return set()
    names = set()
    for node in body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _is_package_state(path: str | None, name: str) -> bool:
    """Whether attribute ``name`` of the package object at ``path`` is data: a module's or a
    class's variable, or any attribute of a module-level object (an instance)."""
    if not path or not path.startswith("megatron_mesh."):
        return False
    data = _data_names(path)
    if data or path in _modules():
        return name in data
    parent, obj = path.rsplit(".", 1)
    return obj in _data_names(parent)  # an attribute of a module-level object (an instance)


def test_monkeypatches_of_package_state():
    """Tests inject objects (a Telemetry, CPGroups, Tunables, ProcessState, ...) instead of
    patching the package's module or class variables: every monkeypatch.setattr / setitem /
    delattr, and every assignment, of package data in the tests -- at most 5, each named here
    with why it stays. (Patching a function -- a fake timer, a fake store client -- is a seam, not
    state, and is not counted.)"""
    found = []
    for root, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            tree = _tree(path)
            aliases = _module_aliases(tree, "tests")
            for node in ast.walk(tree):
                hit = None
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        isinstance(node.func.value, ast.Name) and node.func.value.id == "monkeypatch" and node.args:
                    how, first = node.func.attr, node.args[0]
                    if how in ("setattr", "delattr") and isinstance(first, ast.Constant):  # "pkg.mod.NAME"
                        target, _, name = first.value.rpartition(".")
                        hit = (target, name)
                    elif how in ("setattr", "delattr") and len(node.args) > 1 \
                            and isinstance(node.args[1], ast.Constant):
                        hit = (_dotted(first, aliases), node.args[1].value)
                    elif how in ("setitem", "delitem") and isinstance(first, ast.Attribute):
                        hit = (_dotted(first.value, aliases), first.attr)
                elif isinstance(node, (ast.Assign, ast.AugAssign)):
                    for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        t = t.value if isinstance(t, ast.Subscript) else t
                        if isinstance(t, ast.Attribute):
                            hit = (_dotted(t.value, aliases), t.attr)
                if hit and _is_package_state(*hit):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {hit[0]}.{hit[1]}")
    remaining = {
        # the checkout a data-file check resolves paths against
        "megatron_mesh.megatron.data_checks.ROOT",
        # the planner's limit for planning the modes on THD: the tests lower it to reach the refusal on small problems
        "megatron_mesh.plan.layouts.thd.ThdKind.plan_ranks",
    }
    assert len(found) <= 5 and {f.split(": ")[1] for f in found} <= remaining, found


def _set_from_outside(modules: dict[str, str]) -> set[str]:
    """Dotted names a module assigns in another module (``bootstrap.FLAG = True``)."""
    out = set()
    for name, path in modules.items():
        tree = _tree(path)
        aliases = _module_aliases(tree, name if path.endswith("__init__.py") else name.rsplit(".", 1)[0])
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    target = _dotted(t.value, aliases) if isinstance(t, ast.Attribute) else None
                    if target in modules:
                        out.add(f"{target}.{t.attr}")
    return out


def _mutated_module_state(path: str, name: str, set_from_outside: set[str]) -> list[str]:
    """The mutable module-level objects of module ``name`` at ``path``: a name rebound through
    ``global`` or set from another module, a container or synchronisation object that is
    mutated, an instance of a class (a state object), a class whose attributes are assigned."""
    tree = _tree(path)
    top = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        for t in targets:
            if isinstance(t, ast.Name):
                top[t.id] = node.value
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    mutated = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, (ast.Subscript, ast.Attribute)) and isinstance(e.value, ast.Name):
                        mutated.add(e.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                and isinstance(node.func.value, ast.Name):
            mutated.add(node.func.value.id)
    rebound |= {var for var in top if f"{name}.{var}" in set_from_outside}
    out = []
    for var, value in top.items():
        kind = _callee(value) if isinstance(value, ast.Call) else ""
        container = kind in _CONTAINERS or isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp,
                                                              ast.ListComp, ast.SetComp))
        instance = kind[:1].isupper() and kind not in _CONTAINERS and kind != "TypeVar"
        if var in rebound or (container and var in mutated) or instance:
            out.append(f"{name}.{var}")
    out += [f"{name}.{c}" for c in classes if c in mutated]
    return out


def test_mutable_module_state_in_the_adapter_and_the_runtime():
    """State lives in objects the layers, specs and builders hold (Telemetry, CPGroups,
    ProcessState, RuntimeState; per-plan memos in the plan), not in module globals. What
    megatron/ and runtime/ keep at module level: the process's default objects -- at most 3 --,
    which a test replaces by passing its own. ``functools`` caches (memos of pure functions) are
    not state."""
    modules = _modules()
    outside = _set_from_outside(modules)
    found = sorted(s for name, path in modules.items()
                   if name.startswith(("megatron_mesh.megatron", "megatron_mesh.runtime"))
                   for s in _mutated_module_state(path, name, outside))
    assert found == [
        # the process's CP groups, made with torch (process.py runs before torch's import)
        "megatron_mesh.megatron.groups.PROCESS_GROUPS",
        # start-up and exit state, the entry scripts' document flags, the batch's layout from
        # get_batch to the layers and the rotary embeddings that follow it
        "megatron_mesh.megatron.process.PROCESS",
        # the plan check's memory per process group, the prebuild memory, each rank's arena
        "megatron_mesh.runtime.state.RUNTIME",
    ], found


def _functions_never_referenced() -> list[str]:
    """Functions and methods of the package whose name nothing refers to -- no call, attribute,
    import or string (a registry or spec path) in the package, the tests, the scripts or the
    configs; docstrings and ``__all__`` do not count. Dunder methods and the hooks other
    libraries call (``logging.Handler.emit``) are not asked for."""
    hooks = {"emit"}
    used, defs = set(), []
    for folder in ("megatron_mesh", "tests", "scripts"):
        for root, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(root, f)
                tree = _tree(path)
                skip = set()
                for node in ast.walk(tree):
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                            and node.body and isinstance(node.body[0], ast.Expr) \
                            and isinstance(node.body[0].value, ast.Constant):
                        skip.add(id(node.body[0].value))
                    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                        skip.update(id(n) for n in ast.walk(node.value))
                for node in ast.walk(tree):
                    if id(node) in skip:
                        continue
                    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                        used.add(node.id)
                    elif isinstance(node, ast.Attribute):
                        used.add(node.attr)
                    elif isinstance(node, ast.ImportFrom):
                        used.update(a.name for a in node.names)
                    elif isinstance(node, ast.keyword) and node.arg:
                        used.add(node.arg)
                    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                        used.update(re.findall(r"[A-Za-z_]\w*", node.value))
                if folder == "megatron_mesh":
                    for node in tree.body:
                        members = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                            [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))] \
                            if isinstance(node, ast.ClassDef) else []
                        defs += [(os.path.relpath(path, ROOT), m.name) for m in members]
    for name in ["pyproject.toml"] + [os.path.join(d, f) for d in ("configs", "scripts")
                                      for f in os.listdir(os.path.join(ROOT, d)) if not f.endswith(".py")]:
        if os.path.isfile(os.path.join(ROOT, name)):
            used.update(re.findall(r"[A-Za-z_]\w*", open(os.path.join(ROOT, name)).read()))
    return sorted(f"{path}: {n}" for path, n in defs
                  if n not in used and n not in hooks and not (n.startswith("__") and n.endswith("__")))


def test_every_function_of_the_package_is_used():
    assert _functions_never_referenced() == []


def test_the_readme_names_every_environment_variable_the_package_reads():
    """One place for the process settings: the README's table names every ``MEGATRON_MESH_*``
    variable the package reads or sets."""
    names = set()
    for path in _modules().values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"\bMEGATRON_MESH_[A-Z_]+\b", node.value))
    names -= {"MEGATRON_MESH_CP_SUBGROUP", "MEGATRON_MESH_CP_CHECK"}  # process groups' descriptions, not variables
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme[readme.index("### Environment variables"):]
    assert len(names) >= 5 and {n for n in names if f"`{n}`" not in table} == set(), names


def test_the_glossary_that_the_docs_point_to_defines_their_words():
    """README and the IR's docstring point to the glossary in docs/design.md: it is there, and it
    defines every word the IR's docstring says are its (and "piece" once: the mask piece)."""
    design = open(os.path.join(ROOT, "docs", "design.md")).read()
    glossary = design[design.index("\n## Glossary\n"):]
    glossary = glossary[:glossary.index("\n## ", 1)]
    words = {w.strip() for row in re.findall(r"^\| ([^|]+) \|", glossary, re.M) for w in row.split(",")}
    ops = _tree(os.path.join(PACKAGE, "plan", "ir", "ops.py"))
    listed = re.search(r"Words \(([^)]*)\)\s+are those of the glossary in docs/design.md", ast.get_docstring(ops))
    assert listed and set(listed.group(1).replace("\n", " ").split(", ")) <= words, (listed, words)
    assert "(docs/design.md#glossary)" in open(os.path.join(ROOT, "README.md")).read()
    assert [w for w in words if "piece" in w] == ["mask piece"]



def test_plan_facts_are_read_typed():
    """Outside the plan layer -- whose fact families own these words -- nothing compares a plan's
    assignment, schedule, round order or kernel calls with a string: readers ask the typed facts
    (``plan.facts.tile_placed``, ``plan.facts.direct``, ...). Issue 49: the telemetry compared
    ``assignment == "tile"``."""
    facts = {"assignment", "schedule", "rounds", "kernel_calls"}

    def name(node) -> str | None:
        return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None

    def text(node) -> bool:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items)

    found = [f"{module}:{node.lineno} {ast.unparse(node)}" for module, path in _modules().items()
             if not module.startswith("megatron_mesh.plan.") for node in ast.walk(_tree(path))
             if isinstance(node, ast.Compare) and any(name(s) in facts for s in (node.left, *node.comparators))
             and any(text(s) for s in (node.left, *node.comparators))]
    assert found == [], found


# -- size: files, functions and classes stay small -----------------------------------------------------------
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_CLASS_LINES = 500, 60, 200
# what is over its limit today, with its size: it may only shrink (and leave the list once under)
OVER_LIMIT: dict[str, int] = {}


def _sizes_over_limits() -> dict[str, int]:
    """'file' or 'file:Class.function' -> lines, for every package file over MAX_FILE_LINES and
    every function or class over its limit (nested ones too, named by their path)."""
    out = {}

    def walk(node, rel: str, prefix: str) -> None:
        for c in ast.iter_child_nodes(node):
            if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                limit = MAX_CLASS_LINES if isinstance(c, ast.ClassDef) else MAX_FUNCTION_LINES
                if c.end_lineno - c.lineno + 1 > limit:
                    out[f"{rel}:{prefix}{c.name}"] = c.end_lineno - c.lineno + 1
                walk(c, rel, f"{prefix}{c.name}.")
            else:
                walk(c, rel, prefix)
    for path in _modules().values():
        rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        with open(path) as f:
            lines = len(f.read().splitlines())
        if lines > MAX_FILE_LINES:
            out[rel] = lines
        walk(_tree(path), rel, "")
    return out


def test_files_functions_and_classes_stay_under_their_sizes():
    """No package file over 500 lines, function over 60, class over 200 -- except the ones listed
    in OVER_LIMIT, each no larger than listed; one that got under its limit leaves the list."""
    over = _sizes_over_limits()
    grown = {k: (n, OVER_LIMIT.get(k)) for k, n in over.items() if n > OVER_LIMIT.get(k, 0)}
    assert not grown, f"over the size limits (lines, allowed): {grown}: split along a seam"
    stale = sorted(set(OVER_LIMIT) - set(over))
    assert not stale, f"now under their limits: remove {stale} from OVER_LIMIT"
