"""The pipeline engine stays readable: no function in gpipe_tf/gpipe/ is longer than one screen (60 lines, nested
functions counted in their parent), so each schedule's loop reads as named steps."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LINES = 60


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function in `source` longer than `limit` lines, decorators excluded."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit]


def test_long_functions_finds_a_long_one():
    body = "\n".join(f"    x{j} = {j}" for j in range(61))
    assert long_functions(f"def short():\n    return 1\n\n\ndef long():\n{body}\n", MAX_LINES) == [("long", 62)]


def test_no_function_of_the_pipeline_engine_passes_one_screen():
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "gpipe_tf", "gpipe", "*.py"))):
        with open(path, encoding="utf-8") as f:
            found += [f"{os.path.relpath(path, ROOT)}: {name} ({lines} lines)"
                      for name, lines in long_functions(f.read(), MAX_LINES)]
    assert not found, f"functions over {MAX_LINES} lines: {found}; split them into named steps"
