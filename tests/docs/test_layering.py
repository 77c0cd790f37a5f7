"""The floors of docs/layout.md hold: no module imports one on a higher floor, no modules import each other (directly
or around a cycle), and every import inside a function in gpipe_tf/ says on its line, or the line above, why it is
not at the module's top.

Imports are read from the source with `ast`, at the top and inside functions alike, so an import hidden in a
function counts as much as one at the top. The floors come from the table under "## Floors" in docs/layout.md: the
doc is the source of truth, and a module it puts on no floor fails the test.
"""

import ast
import io
import os
import re
import tokenize

import pytest

from tests.helpers.paths import ROOT

# The checkout's folders and the packages they are installed as (setup.py's package_dir).
FOLDERS = {"gpipe_tf": "gpipe_tf", "model_registry": "gpipe_tf.model_registry", "params": "gpipe_tf.params"}
NOQA = re.compile(r"noqa(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?", re.I)
# A reason is a few words: "noqa: PLC0415" alone, or with one word after it, says nothing about why.
REASON_WORDS = 3


def modules():
    """{dotted module name: path relative to the checkout} of every module of the library's folders."""
    found = {}
    for folder, package in FOLDERS.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                if not filename.endswith(".py"):
                    continue
                path = os.path.relpath(os.path.join(dirpath, filename), ROOT).replace(os.sep, "/")
                parts = path[:-len(".py")].split("/")[1:]
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([package, *parts])] = path
    return found


def _resolve(name, known):
    """The module `name` runs: itself, or the longest prefix of it that is a module (a.b.func -> a.b)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imported_modules(source, module, is_package, known):
    """[(line, imported module)] of every import of a module in `known` by `module`, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package `module` is in (or is), up level - 1 packages
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            # `from pkg import name`: the module pkg.name when there is one, else pkg itself.
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module:
                found.append((node.lineno, resolved))
    return found


def import_graph():
    """{module: [(line, imported module)]} over the library's modules, and their paths."""
    known = modules()
    graph = {}
    for module, path in known.items():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            graph[module] = imported_modules(f.read(), module, path.endswith("__init__.py"), known)
    return graph, known


def floors():
    """{path or folder/: floor} from the table under "## Floors" in docs/layout.md."""
    with open(os.path.join(ROOT, "docs", "layout.md"), encoding="utf-8") as f:
        section = re.search(r"^## Floors$(.*?)(?=^#|\Z)", f.read(), flags=re.M | re.S)
    assert section, "docs/layout.md has no '## Floors' section"
    table = {}
    for number, cell in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", section.group(1), flags=re.M):
        for entry in re.findall(r"`([^`]+)`", cell):
            assert entry not in table, f"docs/layout.md puts {entry} on two floors"
            table[entry] = int(number)
    assert table, "docs/layout.md's '## Floors' section has no table rows"
    return table


def floor_of(path, table):
    """The floor of the module at `path`: its own entry, else its nearest folder's; None if it has none."""
    matches = [entry for entry in table if entry == path or (entry.endswith("/") and path.startswith(entry))]
    return table[max(matches, key=len)] if matches else None


def cycles(graph):
    """Every import cycle, as [a, b, ..., a]: one per strongly connected group of modules (Tarjan)."""
    edges = {module: sorted({target for _, target in imports}) for module, imports in graph.items()}
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in edges.get(module, []):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    found = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}  # breadth-first inside the group, back to the start
        queue = [start]
        while queue:
            module = queue.pop(0)
            for target in edges[module]:
                if target == start:
                    found.append(paths[module] + [start])
                    queue = []
                    break
                if target in group and target not in paths:
                    paths[target] = paths[module] + [target]
                    queue.append(target)
    return found


def test_every_module_has_a_floor():
    table = floors()
    missing = sorted(path for path in modules().values() if floor_of(path, table) is None)
    assert not missing, f"modules on no floor of docs/layout.md's '## Floors' table: {missing}"
    absent = sorted(entry for entry in table if not os.path.exists(os.path.join(ROOT, entry)))
    assert not absent, f"docs/layout.md's '## Floors' table names what does not exist: {absent}"


def test_no_module_imports_one_on_a_higher_floor():
    table = floors()
    graph, paths = import_graph()
    upward = set()
    for module, imports in sorted(graph.items()):
        own = floor_of(paths[module], table)
        for line, target in imports:
            theirs = floor_of(paths[target], table)
            if own is not None and theirs is not None and theirs > own:
                upward.add(f"{module} (floor {own}) -> {target} (floor {theirs}) at {paths[module]}:{line}")
    assert not upward, "imports up the floors of docs/layout.md:\n" + "\n".join(sorted(upward))


def test_no_modules_import_each_other():
    graph, _ = import_graph()
    found = [" -> ".join(cycle) for cycle in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_cycles_are_found():
    graph = {"a": [(1, "b")], "b": [(1, "c")], "c": [(1, "a")], "d": [(1, "a")]}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": [(1, "b")], "b": []}) == []


def test_imports_resolve_to_modules():
    known = {"p", "p.sub", "p.sub.mod", "p.other"}
    source = ("import p.sub.mod\nfrom p.sub import mod, helper\nfrom p import other\n"
              "def f():\n    from . import other\n    from .sub.mod import g\n")
    assert imported_modules(source, "p.x", False, known) == [
        (1, "p.sub.mod"), (2, "p.sub.mod"), (2, "p.sub"), (3, "p.other"), (5, "p.other"), (6, "p.sub.mod")]


def unexplained_function_imports(source):
    """[(line, statement)] of imports inside a function or class whose line (or lines), or the comment line just
    above, carry no reason of a few words besides a noqa code."""
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    lines = source.splitlines()
    nested = []

    def walk(node, inside):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inside:
                nested.append(child)
            walk(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    walk(ast.parse(source), False)
    found = []
    for node in nested:
        texts = [comments.get(n, "") for n in range(node.lineno, node.end_lineno + 1)]
        above = node.lineno - 1
        while above >= 1 and lines[above - 1].lstrip().startswith("#"):  # the comment block just above
            texts.append(comments.get(above, ""))
            above -= 1
        reasons = [re.findall(r"[A-Za-z]{2,}", NOQA.sub("", text.lstrip("#"))) for text in texts]
        if not any(len(words) >= REASON_WORDS for words in reasons):
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_every_import_inside_a_function_says_why():
    found = []
    for path in sorted(modules().values()):
        if not path.startswith("gpipe_tf/"):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            found += [f"{path}:{line}: {text}" for line, text in unexplained_function_imports(f.read())]
    assert not found, ("imports inside functions without a comment saying why they are not at the module's top "
                       "(e.g. '# noqa: PLC0415 -- deferred: ...'):\n" + "\n".join(found))


@pytest.mark.parametrize("source, unexplained", [
    ("import os\n\ndef f():\n    import re  # noqa: PLC0415\n", [4]),
    ("def f():\n    import re  # noqa: PLC0415 -- why\n", [2]),
    ("def f():\n    import re\n", [2]),
    ("class A:\n    def f(self):\n        from os import path\n", [3]),
    ("def f():\n    import re  # noqa: PLC0415 -- deferred: the module must load without it\n", []),
    ("def f():\n    # deferred: the module must load without it\n    import re  # noqa: PLC0415\n", []),
    ("def f():\n    from os import (  # noqa: PLC0415 -- deferred: it is slow to load\n        path,\n    )\n", []),
    ("import re\nif re:\n    import os\n", []),
])
def test_a_bare_noqa_is_no_reason(source, unexplained):
    assert [line for line, _ in unexplained_function_imports(source)] == unexplained
