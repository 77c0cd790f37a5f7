"""TensorFlow's start-up without its native start-up notices on the console.

TensorFlow 2.21 writes a few lines from C++ while it loads and first lists devices, before its logging is set up,
so `TF_CPP_MIN_LOG_LEVEL` cannot silence them: "All log messages before absl::InitializeLog() ...", "oneDNN
custom operations are on", "Could not find cuda drivers", "failed call to cuInit" (on a machine without a GPU),
twice each. Around a one-line error they are noise a user must read past. `start_tensorflow` imports TensorFlow
and lists the devices with the process's standard error (file descriptor 2) sent into a pipe, then writes back
every line except those known notices: anything else TensorFlow says there still reaches the console.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

# Exactly the notices named above; nothing that could report a real problem.
KNOWN_NOTICES = tuple(re.compile(p) for p in (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    r"^I\d{4} [\d:. ]+\d+ port\.cc:\d+\] oneDNN custom operations are on\.",
    r"^I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine",
    r"^E\d{4} [\d:. ]+\d+ cuda_platform\.cc:\d+\] failed call to cuInit: ",
    r"^I\d{4} [\d:. ]+\d+ cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use available CPU",
    r"^To enable the following instructions: .* in other operations, rebuild TensorFlow with the appropriate",
))


def is_known_notice(line: str) -> bool:
    """Whether `line` is one of TensorFlow's native start-up notices (see the module doc)."""
    return any(pattern.search(line.rstrip("\n")) for pattern in KNOWN_NOTICES)


@contextlib.contextmanager
def known_notices_dropped() -> Iterator[None]:
    """Within the block, file descriptor 2 goes into a pipe drained by a thread; afterwards (also on an exception)
    every line written there that is not a known notice is written to standard error, in order.

    A pipe, not a file: a process limited in file size (RLIMIT_FSIZE) would cut a file short and lose lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    chunks: list[bytes] = []

    def drain() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            while chunk := pipe.read1(65536):
                chunks.append(chunk)

    reader = threading.Thread(target=drain, name="tf-startup-stderr", daemon=True)
    reader.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the reader sees its end
        os.close(saved)
        reader.join()
        text = b"".join(chunks).decode("utf-8", errors="replace")
        kept = [line if line.endswith("\n") else line + "\n" for line in text.splitlines(keepends=True)
                if not is_known_notice(line)]
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def start_tensorflow() -> None:
    """Imports TensorFlow and lists the physical devices (which loads the GPU driver where there is one) without
    the known start-up notices. Lists devices only: logical devices can still be configured afterwards."""
    with known_notices_dropped():
        import tensorflow as tf  # noqa: PLC0415 -- here, so that its native notices go into the pipe

        tf.config.list_physical_devices()
