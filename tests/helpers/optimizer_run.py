"""A training run of BlobsMlpGPipe (float64, no dropout, 2 stages) with one of the optimizer setups below.

Used by tests/training/test_optimizer_resume.py as a real process:
`python tests/helpers/optimizer_run.py SETUP LOGDIR MAX_STEPS [KILL_AFTER]` trains to MAX_STEPS, checkpointing every
4 steps; with KILL_AFTER it SIGKILLs itself right after writing the checkpoint of that step (a crash at a known
point, no timing involved, which trainer.py offers no hook for).
"""

import os
import signal
import sys

from gpipe_tf import devices

devices.split_cpu(2)

from gpipe_tf import experiment  # noqa: E402  (after the devices are configured)
from gpipe_tf.training import logdir as logdir_lib  # noqa: E402
from gpipe_tf.training.adafactor import Adafactor  # noqa: E402
from gpipe_tf.training.controller import Controller  # noqa: E402
from gpipe_tf.training.optimizers import Adam, AdamW  # noqa: E402

KEY = "toy.classifier.BlobsMlpGPipe"
SETUPS = {
    "adamw": (AdamW.params().set(weight_decay=0.1, decay_exclude="/b:"), 0.0),
    "adafactor": (Adafactor.params().set(min_dim_size_to_factor=8, beta1=0.9), 0.0),
    "adam_ema": (Adam.params(), 0.9),
}


def params_of(setup: str):
    """The run's frozen Params: float64, no dropout, checkpoints every 4 steps, the setup's optimizer and EMA."""
    params, _ = experiment.resolve_params(
        KEY, gin_bindings=["BlobsMlpGPipe.dtype='float64'", "BlobsMlpGPipe.dropout_rate=0.0"],
        overrides="train.save_interval_steps=4,train.log_interval_steps=1")
    p = params.copy()
    p.train.optimizer, p.train.ema_decay = SETUPS[setup]
    return p


def main(setup: str, logdir: str, max_steps: int, kill_after: int | None) -> None:
    """Trains (or resumes) to `max_steps`; SIGKILLs this process after the checkpoint of step `kill_after`."""
    p = params_of(setup)
    p.train.max_steps = max_steps
    p = p.freeze()

    def log(line: str) -> None:
        print(line, flush=True)
        if kill_after is not None and line == f"saved checkpoint {logdir}/checkpoints/ckpt-{kill_after}":
            os.kill(os.getpid(), signal.SIGKILL)

    logdir_lib.prepare(logdir, p)
    Controller(p, logdir, log=log).train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
