"""The trainer's flags table in docs/trainer.md lists exactly the flags the trainer defines, and every flag a
trainer command in the README or docs passes exists."""

import glob
import os
import re

from absl import flags

from gpipe_tf import trainer_main as trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Flags absl itself defines for every program, which a command may pass.
ABSL_FLAGS = {"help", "helpshort", "helpfull", "helpxml", "flagfile", "undefok"}


def trainer_flags():
    return {flag.name for flag in flags.FLAGS.get_flags_for_module(trainer)}


def documented_flags():
    with open(os.path.join(ROOT, "docs", "trainer.md"), encoding="utf-8") as f:
        section = f.read().split("## Flags", 1)[1].split("\n## ", 1)[0]
    names = set()
    for first_column in re.findall(r"^\|([^|]*)\|", section, flags=re.M):
        names |= set(re.findall(r"`--([a-z_]+)", first_column))
    return names


def test_flags_table_matches_the_trainer():
    defined, documented = trainer_flags(), documented_flags()
    assert defined, "no flags found for the trainer module"
    assert not defined - documented, f"trainer flags missing from docs/trainer.md: {sorted(defined - documented)}"
    assert not documented - defined, f"documented flags the trainer does not define: {sorted(documented - defined)}"


def test_trainer_commands_in_the_docs_pass_only_defined_flags():
    allowed = trainer_flags() | ABSL_FLAGS
    bad = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for block in re.findall(r"^```\n(.*?)^```$", text, flags=re.S | re.M):
            # A command may continue over lines ending with a backslash.
            for command in block.replace("\\\n", " ").splitlines():
                if "trainer.py" in command or "gpipe-trainer" in command:
                    bad += [(os.path.basename(path), name) for name in re.findall(r"\s--([a-z_]+)", command)
                            if name not in allowed]
    assert not bad, f"trainer commands in the docs pass flags the trainer does not define: {sorted(set(bad))}"
