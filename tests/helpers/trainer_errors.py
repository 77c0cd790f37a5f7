"""What a failing trainer process must show, and the faults tests inject into one."""

import resource
import signal
import subprocess
from collections.abc import Callable


def one_error_line(result: subprocess.CompletedProcess, code: int = 2, only: bool = True) -> str:
    """The `trainer.py: error:` line of a run that must exit with `code`, with no traceback.

    only: stderr holds that line and nothing else (TensorFlow's start-up notices are dropped by the trainer). False
    where TensorFlow itself still writes a warning before the error (a native OP_REQUIRES warning when a write
    fails, AutoGraph's when it cannot write its temporary files, NumPy's overflow warning on a huge cast): then
    the error line must still be the only `trainer.py: error:` line and the last line.
    """
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("trainer.py: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr[-3000:]
    assert not only or len(lines) == 1, result.stderr[-3000:]
    return errors[0]


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """`result` exited with 2 and printed one `trainer.py: error:` line that holds every fragment."""
    assert result.returncode == 2, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("trainer.py: error: ")]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


def file_size_limit(limit: int) -> Callable[[], None]:
    """A `preexec_fn` that makes every write of the child past `limit` bytes fail with EFBIG, as on a full disk
    (SIGXFSZ ignored, so the write fails instead of killing the process)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def address_space_limit(limit: int) -> Callable[[], None]:
    """A `preexec_fn` that caps the child's address space at `limit` bytes (RLIMIT_AS), so a larger allocation fails
    at once whatever the machine's memory and overcommit policy."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply
