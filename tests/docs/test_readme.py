"""The README's quick start stays true and the README stays short: CI runs its test command, its run command names
a real model, and the README fits the newcomer's page (topics live in docs/)."""

import os
import re

from gpipe_tf import model_registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
MAX_README_LINES = 220


def quick_start_commands():
    """The fenced blocks of README.md#quick-start, in order."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.+?)\n```", section)


def test_quick_start_has_exactly_two_commands():
    assert len(quick_start_commands()) == 2


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci_lines = [line.strip() for line in f]
    assert quick_start_commands()[1] in ci_lines


def test_run_command_names_a_registered_model():
    models = set(re.findall(r"--model=(\S+)", quick_start_commands()[0]))
    assert models and models <= set(model_registry.list_models()), models


def test_readme_is_short():
    with open(README, encoding="utf-8") as f:
        num_lines = sum(1 for _ in f)
    assert num_lines <= MAX_README_LINES, (f"README.md has {num_lines} lines, more than {MAX_README_LINES}: move the "
                                          "topic you added to its page in docs/ and link it from 'Where to go next'")
