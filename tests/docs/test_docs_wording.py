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


def prose(text):
    """`text` without its fenced blocks and code spans (each replaced by as many newlines, so lines keep their
    numbers): what a reader takes as sentences."""
    without_blocks = re.sub(r"^```.*?^```$", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", without_blocks)


def test_no_now_in_the_prose():
    """'now' dates a sentence (what changed, against what came before); a page says what is true, so the word has
    no place in its prose. In code (a command, a printed line) it may stand."""
    found = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            lines = prose(f.read()).splitlines()
        found += [(os.path.relpath(path, ROOT), number, line.strip()) for number, line in enumerate(lines, 1)
                  if re.search(r"\bnow\b", line, flags=re.I)]
    assert not found, found
