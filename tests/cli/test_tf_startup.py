"""TensorFlow's native start-up notices are dropped around the trainer's start; anything else it writes stays."""

import os
import subprocess
import sys

from gpipe_tf import tf_startup
from tests.helpers.paths import ROOT

NOTICES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795616083.608226   14105 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders.",
    "I0000 00:00:1795616083.608542   14105 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will "
    "not be used.",
    "E0000 00:00:1795616086.591869   14105 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed "
    "call to cuInit: UNKNOWN ERROR (303)",
]


def test_known_notices_are_dropped_and_every_other_line_is_kept_in_order(capfd):
    other = ["E0000 00:00:1795616086.1   14105 cuda_platform.cc:52] failed to allocate 2 bytes",
             "W0000 00:00:1795616086.2   14105 op_kernel.cc:1] something real", "a plain line"]
    with tf_startup.known_notices_dropped():
        os.write(2, "\n".join([NOTICES[0], other[0], *NOTICES[1:], other[1], other[2]]).encode() + b"\n")
    assert capfd.readouterr().err.splitlines() == other


def test_lines_written_before_an_exception_still_reach_the_console(capfd):
    try:
        with tf_startup.known_notices_dropped():
            os.write(2, b"the reason it failed\n")
            raise ImportError("broken")
    except ImportError:
        pass
    assert capfd.readouterr().err == "the reason it failed\n"


def test_a_user_error_after_tensorflow_starts_is_exactly_one_line(tmp_path):
    result = subprocess.run([sys.executable, "trainer.py", "--model=toy.classifier.BlobsMlp", "--mode=eval",
                             f"--logdir={tmp_path / 'run'}", f"--checkpoint={tmp_path / 'nothing'}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer.py: error: --checkpoint="), result.stderr
