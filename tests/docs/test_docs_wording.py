"""No sentence of the README or docs describes the past or the future of the work: nothing about a session or
what comes next. A reader should be able to take every sentence as true of the code beside it."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATED = [r"\bsessions?\b", r"\bcomes? next\b", r"\bwill come\b", r"\bpredates?\b", r"\bbefore the group order\b"]


def test_no_dated_sentences():
    found = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                found += [(os.path.relpath(path, ROOT), number, line.strip()) for pattern in DATED
                          if re.search(pattern, line, flags=re.I)]
    assert not found, found
