"""docs/dependencies.md names exactly the packages setup.py requires (install_requires and every extra), so the
reasons it gives cover every dependency and no dropped one."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def normalize(name):
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement):
    return normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0))


def setup_requirements():
    """Project names in setup()'s install_requires and extras_require, read from setup.py without running it."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires",
                                                                                      "extras_require")}
    names = {requirement_name(r) for r in keywords["install_requires"]}
    for extra in keywords.get("extras_require", {}).values():
        names |= {requirement_name(r) for r in extra}
    return names


def documented_packages():
    """The backquoted package names in the first column of the package tables of docs/dependencies.md (in the
    extras table, the package column)."""
    with open(os.path.join(ROOT, "docs", "dependencies.md"), encoding="utf-8") as f:
        text = f.read()
    names = set()
    for table in re.findall(r"((?:^\|.*\|\n)+)", text, flags=re.M):
        header, _, *rows = table.splitlines()
        columns = [c.strip() for c in header.strip("|").split("|")]
        column = columns.index("package")
        for row in rows:
            cell = row.strip("|").split("|")[column]
            names |= {normalize(n) for n in re.findall(r"`([A-Za-z0-9._-]+)`", cell)}
    return names


def test_dependencies_doc_matches_setup_py():
    required, documented = setup_requirements(), documented_packages()
    assert required, "no requirements found in setup.py"
    assert not required - documented, f"required by setup.py, not explained in docs: {sorted(required - documented)}"
    assert not documented - required, f"explained in docs, not required by setup.py: {sorted(documented - required)}"
