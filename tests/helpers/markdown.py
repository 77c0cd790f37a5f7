"""The README and docs pages as the docs tests read them: the pages, and GitHub's anchors of their headings."""

import glob
import os
import re

from tests.helpers.paths import ROOT


def pages() -> list[str]:
    """README.md, then every docs/*.md page, as absolute paths."""
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of the headings of a markdown file (a `#` line inside a fenced block is not a heading)."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```$", "", read(path), flags=re.S | re.M), flags=re.M)
    return {heading_anchor(h) for h in headings}
