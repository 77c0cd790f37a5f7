"""Every `tf.function` of the package, the benchmarks and the tests traces without AutoGraph, as the trainer does
(docs/experiments.md#control-flow-in-a-layer): AutoGraph's rewrite of the code a step calls costs seconds of Python
per process, and a test that traced with it could pass on code the trainer cannot trace."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def autograph_functions(source: str) -> list[int]:
    """Lines of the `tf.function` uses in `source` that do not pass `autograph=` (a call or a bare decorator)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_tf_function(node.func):
            if not any(keyword.arg == "autograph" for keyword in node.keywords):
                found.append(node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [d.lineno for d in node.decorator_list if _is_tf_function(d)]
    return sorted(found)


def _is_tf_function(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "function" and isinstance(node.value, ast.Name)
            and node.value.id == "tf")


def test_autograph_functions_finds_calls_and_bare_decorators():
    source = ("f = tf.function(g)\nh = tf.function(g, autograph=False)\n\n\n@tf.function\ndef a():\n    pass\n\n\n"
              "@tf.function(jit_compile=True)\ndef b():\n    pass\n\n\n@tf.function(autograph=False)\ndef c():\n"
              "    pass\n")
    assert autograph_functions(source) == [1, 5, 10]


def test_every_tf_function_says_whether_autograph_converts_it():
    found = []
    for pattern in ("gpipe_tf/**/*.py", "bench/**/*.py", "tests/**/*.py", "params/**/*.py", "model_registry/*.py",
                    "*.py"):
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            with open(path, encoding="utf-8") as f:
                found += [f"{os.path.relpath(path, ROOT)}:{line}" for line in autograph_functions(f.read())]
    assert not found, (f"tf.function without autograph= at {found}; pass autograph=False "
                       "(docs/experiments.md#control-flow-in-a-layer)")
