"""Every relative link of the README and docs leads somewhere: the file exists and an #anchor names one of its
headings; every file a page names by its repository path exists; every docs page is reachable from the README."""

import os
import re

from tests.helpers.markdown import anchors, pages, read
from tests.helpers.paths import ROOT

# Top-level folders of the repository whose files the docs name in backquotes, e.g. `gpipe_tf/gpipe/plan.py`.
REPOSITORY_FOLDERS = ("gpipe_tf", "bench", "tests", "params", "model_registry", "docs")


def relative_links(path):
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", read(path))
            if not re.match(r"[a-z]+://|mailto:", target)]


def test_relative_links_resolve():
    broken = []
    for page in pages():
        for target in relative_links(page):
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
            if not os.path.exists(resolved):
                broken.append((os.path.relpath(page, ROOT), target, "no such file"))
            elif anchor and anchor not in anchors(resolved):
                broken.append((os.path.relpath(page, ROOT), target, "no such heading"))
    assert not broken, broken


def test_repository_paths_named_in_the_docs_exist():
    missing = []
    for page in pages():
        for path in re.findall(rf"`((?:{'|'.join(REPOSITORY_FOLDERS)})/[\w./-]*)`", read(page)):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append((os.path.relpath(page, ROOT), path))
    assert not missing, f"files named in the docs that do not exist: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(ROOT, t.partition("#")[0]))
              for t in relative_links(os.path.join(ROOT, "README.md"))}
    orphans = [os.path.relpath(p, ROOT) for p in pages()[1:] if os.path.normpath(p) not in linked]
    assert not orphans, f"docs pages README.md#where-to-go-next does not link: {orphans}"
