"""The README's quick start stays true: CI runs its test command, its run command names a real model."""

import os
import re

from gpipe_tf import model_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quick_start_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
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
    model = re.search(r"--model=(\S+)", quick_start_commands()[0]).group(1)
    assert model in model_registry.list_models()
