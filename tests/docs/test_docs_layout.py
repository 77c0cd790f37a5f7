"""docs/layout.md names every module of the library and the benchmarks, so a reader finds each concept there."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_layout_names_every_module():
    with open(os.path.join(ROOT, "docs", "layout.md"), encoding="utf-8") as f:
        layout = f.read()
    missing = []
    for package in ("gpipe_tf", "bench"):
        for path in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True):
            relative = os.path.relpath(path, ROOT).replace(os.sep, "/")
            folder, name = relative.rsplit("/", 1)
            stem = name[:-len(".py")]
            if stem == "__init__":
                continue
            # Named by its path (gpipe_tf/devices.py), or by its name on its folder's line (gpipe_tf/gpipe/: ...).
            lines = [line for line in layout.splitlines() if relative in line]
            block = re.search(rf"^{re.escape(folder)}/ .*(?:\n {{20,}}.*)*", layout, flags=re.M)
            if not lines and not (block and re.search(rf"\b{re.escape(stem)}\b", block.group(0))):
                missing.append(relative)
    assert not missing, f"modules docs/layout.md does not name: {sorted(missing)}"
