"""Every pointer the code and the docs give a reader leads somewhere.

The code (docstrings, comments, help and error text alike: the raw text of every .py file of gpipe_tf/, bench/,
params/, model_registry/, tests/ and trainer.py) cites a README or docs section in one form, the page and GitHub's
anchor of the heading (docs/contributing.md#style): the page must exist and the anchor must be one of its headings.
A page named by its file name, a repository path, a module file name in backquotes and a dotted module path (of
gpipe_tf, bench, model_registry or tests) must name something that exists. The README and docs may point at a
section in prose, a page followed by the heading in quotes: that heading must exist too. And a package docstring
that lists its modules lists every one of them and nothing else.
"""

import ast
import os
import re

from tests.helpers.markdown import anchors, heading_anchor, pages, read
from tests.helpers.paths import ROOT

CODE_FOLDERS = ("gpipe_tf", "bench", "params", "model_registry", "tests")
REPOSITORY_FOLDERS = ("gpipe_tf", "bench", "tests", "params", "model_registry", "docs")
# Top-level packages whose dotted paths (`gpipe_tf.gpipe.plan`, `bench.pipeline`) the text may name.
DOTTED_ROOTS = ("gpipe_tf", "bench", "model_registry", "tests")

# A page: README.md or a docs page, by its repository path (docs/memory.md) or its file name (memory.md).
_PAGE = r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)\b"
# A cited section in GitHub's anchor form: the page, '#', the anchor.
_ANCHOR = r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)#([\w-]*)"
# A section cited by its heading in quotes after the page (or after the name of the README), optionally with a
# comma between. The heading starts with a letter or a backquote; an apostrophe and an s is no quote.
_QUOTED = (r"(?<![\w/.-])(README(?:\.md)?|(?:docs/)?[\w-]+\.md)`?(?:'s)?,?[ \t]*([\"'\u201c])(?!s\b)"
           r"([A-Za-z`][^\"'\u201d\n]*?)[\"'\u201d]")
# The README cited without saying where in it: a few words then "section", an order to look at it, or a claim
# about what it holds. Such text cites the section instead.
_VAGUE = (r"README's(?: [\w-]+){1,3} section\b|README[ ]section\b|README[ ](?:quotes|lists|says|shows|gives|has)\b"
          r"|\b[Ss]ee (?:the )?README\b(?!\.md)")
_REPOSITORY_PATH = rf"(?<![\w./-])((?:{'|'.join(REPOSITORY_FOLDERS)})/[\w./-]*)"
_MODULE_FILE = r"`(\w+\.py)`"
_DOTTED = rf"(?<![\w.])((?:{'|'.join(DOTTED_ROOTS)})(?:\.\w+)+)"



def relative(path):
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def code_files():
    """trainer.py and every .py file of the code folders, as absolute paths."""
    found = [os.path.join(ROOT, "trainer.py")]
    for folder in CODE_FOLDERS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            found += [os.path.join(dirpath, name) for name in sorted(filenames) if name.endswith(".py")]
    return found


def repository_module_files():
    """The file name of every .py file of the repository (outside virtualenvs and build folders), and of every
    .py file a test writes (a user's module such as the out-of-memory test's, which the docs name)."""
    names = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("__pycache__", "build", "dist")
                       and not d.endswith(".egg-info")]
        names |= {name for name in filenames if name.endswith(".py")}
        if relative(dirpath).split("/")[0] == "tests":
            for name in filenames:
                if name.endswith(".py"):
                    names |= set(re.findall(r"[\"'](\w+\.py)[\"']", read(os.path.join(dirpath, name))))
    return names


def installed_folders():
    """setup.py's package_dir: the folders installed under another name, e.g. {'gpipe_tf/params': 'params'}."""
    pairs = re.findall(r'"(gpipe_tf\.\w+)": "(\w+)"', read(os.path.join(ROOT, "setup.py")))
    assert pairs, "setup.py's package_dir maps no folder: update installed_folders"
    return {name.replace(".", "/"): folder for name, folder in pairs}


def page_file(name):
    """The file a page name stands for (the README, by name or file name, or a page of docs/, by its path or its
    file name), or None."""
    if name in ("README", "README.md"):
        return os.path.join(ROOT, "README.md")
    for candidate in (os.path.join(ROOT, name), os.path.join(ROOT, "docs", name)):
        if os.path.isfile(candidate):
            return candidate
    return None


def hits(pattern, text):
    """(line number, match) of every match of `pattern` in `text`."""
    return [(text.count("\n", 0, m.start()) + 1, m) for m in re.finditer(pattern, text)]


def section_problems(text):
    """(line, pointer, what is wrong) of every page, anchor or quoted section `text` cites that does not resolve."""
    problems = []
    for line, m in hits(_PAGE, text):
        if page_file(m.group(1)) is None:
            problems.append((line, m.group(0), "no such page: the pages are README.md and docs/*.md"))
    for line, m in hits(_ANCHOR, text):
        page = page_file(m.group(1))
        if page and m.group(2) not in anchors(page):
            problems.append((line, m.group(0), f"no such heading in {relative(page)}: its anchors are "
                                                f"{sorted(anchors(page))}"))
    for line, m in hits(_QUOTED, text):
        page = page_file(m.group(1))
        if page and heading_anchor(m.group(3)) not in anchors(page):
            problems.append((line, m.group(0), f"no such heading in {relative(page)}: its anchors are "
                                                f"{sorted(anchors(page))}"))
    return problems


def path_exists(path, installed):
    path = path.rstrip(".")
    for name, folder in installed.items():
        if path == name or path.startswith(name + "/"):
            path = folder + path[len(name):]
    return os.path.exists(os.path.join(ROOT, path))


def dotted_resolves(dotted, installed):
    """Whether `dotted` (gpipe_tf.gpipe.plan.make_plan) walks through packages to a module, or to a name that its
    last package's __init__.py defines; what follows a module is its attributes."""
    parts = dotted.split(".")
    folder = os.path.join(ROOT, parts[0])
    for depth, part in enumerate(parts[1:], 1):
        name = "/".join(parts[:depth + 1])
        if name in installed:
            folder = os.path.join(ROOT, installed[name])
        elif os.path.isfile(os.path.join(folder, part, "__init__.py")):
            folder = os.path.join(folder, part)
        elif os.path.isfile(os.path.join(folder, part + ".py")):
            return True
        else:
            init = os.path.join(folder, "__init__.py")
            return os.path.isfile(init) and re.search(rf"\b{re.escape(part)}\b", read(init)) is not None
    return True


def name_problems(text, installed, module_files):
    """(line, pointer, what is wrong) of every repository path, module file name and dotted module path in `text`
    that names nothing."""
    problems = []
    for line, m in hits(_REPOSITORY_PATH, text):
        if not path_exists(m.group(1), installed):
            problems.append((line, m.group(1), "no such file or folder in the repository"))
    for line, m in hits(_MODULE_FILE, text):
        if m.group(1) not in module_files:
            problems.append((line, m.group(0), "no module file of that name in the repository"))
    for line, m in hits(_DOTTED, text):
        if not dotted_resolves(m.group(1), installed):
            problems.append((line, m.group(1), "no such module (nor a name its package's __init__.py defines)"))
    return problems


def code_problems(check):
    """Every problem `check(text)` finds in the code, as 'file:line: pointer: what is wrong'."""
    found = []
    for path in code_files():
        name = relative(path)
        for line, pointer, why in check(read(path)):
            found.append(f"{name}:{line}: {pointer!r}: {why}")
    return found


def test_sections_cited_in_the_code_exist():
    problems = code_problems(section_problems)
    assert not problems, "\n".join(["pointers to sections or pages that do not exist:"] + problems)


def test_the_code_cites_sections_by_page_and_anchor():
    def form(text):
        return ([(line, m.group(0), "a heading in quotes: cite the page and the heading's anchor, e.g. "
                                    "docs/pipeline.md#schedules (docs/contributing.md#style)")
                 for line, m in hits(_QUOTED, text)]
                + [(line, m.group(0), "names no section: cite the page and the heading's anchor, e.g. "
                                      "README.md#quick-start or docs/pipeline.md#schedules")
                   for line, m in hits(_VAGUE, text)])
    problems = code_problems(form)
    assert not problems, "\n".join(["pointers not in the form of a page and an anchor:"] + problems)


def test_paths_and_modules_named_in_the_code_exist():
    installed, module_files = installed_folders(), repository_module_files()
    problems = code_problems(lambda text: name_problems(text, installed, module_files))
    assert not problems, "\n".join(["names of files or modules that do not exist:"] + problems)


def test_prose_pointers_of_the_docs_resolve():
    installed, module_files = installed_folders(), repository_module_files()
    problems = []
    for page in pages():
        # Link targets are test_docs_links.py's; the rest of the page is prose, code spans and blocks.
        text = re.sub(r"\]\([^)\s]*\)", "]()", read(page))
        problems += [f"{relative(page)}:{line}: {pointer!r}: {why}"
                     for line, pointer, why in section_problems(text) + name_problems(text, installed, module_files)]
    assert not problems, "\n".join(["pointers in the docs that lead nowhere:"] + problems)


# ------------------------------------------------------------------------------------- package module lists
def packages():
    """Every package folder of the library, the benchmarks, the params and the registry."""
    found = []
    for top in ("gpipe_tf", "bench", "params", "model_registry"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            if "__init__.py" in filenames:
                found.append(dirpath)
    return found


def package_modules(folder):
    """The modules and subpackages of the package in `folder`, by name."""
    return ({name[:-len(".py")] for name in os.listdir(folder) if name.endswith(".py") and name != "__init__.py"}
            | {name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name, "__init__.py"))})


def listed_modules(folder):
    """The names a package's docstring gives in backquotes as modules (`plan` or `plan.py`), less its own name."""
    doc = ast.get_docstring(ast.parse(read(os.path.join(folder, "__init__.py")))) or ""
    return set(re.findall(r"`([a-z_][a-z0-9_]*)(?:\.py)?`", doc)) - {os.path.basename(folder)}


def test_package_docstrings_list_exactly_their_modules():
    checked, wrong = [], []
    for folder in packages():
        modules, listed = package_modules(folder), listed_modules(folder)
        if len(modules & listed) < 2:
            continue  # this docstring lists no modules
        checked.append(relative(folder))
        if modules - listed:
            wrong.append(f"{relative(folder)}/__init__.py leaves out {sorted(modules - listed)}")
        if listed - modules:
            wrong.append(f"{relative(folder)}/__init__.py names {sorted(listed - modules)}, which are not modules "
                         f"of the package (its modules: {sorted(modules)})")
    assert {"gpipe_tf", "gpipe_tf/gpipe", "gpipe_tf/memory"} <= set(checked), checked
    assert not wrong, "\n".join(wrong)
