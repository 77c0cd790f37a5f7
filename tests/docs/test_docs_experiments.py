"""The experiments the README and docs name are the registry's: docs/experiments.md lists every registered key once,
and every key a README or docs command or table names is registered."""

import glob
import os
import re

from gpipe_tf import model_registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The package of the README's own example (an experiment of the user's, not a built-in one; test_readme_experiment.py
# runs it).
USER_EXAMPLE_PACKAGE = "mypkg"
KEY = r"[a-z_]+\.[a-z_]+\.[A-Z][A-Za-z0-9_]*"  # <area>.<module>.<Class>


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def table_keys(text):
    """The backquoted keys in the first column of the markdown table rows of `text`."""
    keys = []
    for row in re.findall(r"^\|([^|]*)\|", text, flags=re.M):
        keys.extend(re.findall(rf"`({KEY})`", row))
    return keys


def test_experiments_table_lists_every_registered_key_once():
    section = read("docs/experiments.md").split("## The registered experiments", 1)[1].split("\n## ", 1)[0]
    keys = table_keys(section)
    assert sorted(keys) == sorted(set(keys)), "a key is listed twice"
    registered = set(model_registry.list_models())
    assert not set(keys) - registered, f"listed but not registered: {sorted(set(keys) - registered)}"
    assert not registered - set(keys), f"registered but not in docs/experiments.md: {sorted(registered - set(keys))}"


def test_every_key_the_readme_and_docs_name_is_registered():
    registered = set(model_registry.list_models())
    named = set()
    for path in ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        text = read(path)
        named |= {(path, key) for key in re.findall(rf"--model=({KEY})", text)}
        named |= {(path, key) for key in table_keys(text)}
    unknown = sorted((path, key) for path, key in named
                     if key not in registered and key.split(".")[0] != USER_EXAMPLE_PACKAGE)
    assert not unknown, f"keys named in the docs that the registry does not know: {unknown}"
