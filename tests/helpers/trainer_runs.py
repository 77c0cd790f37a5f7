"""Reading what a trainer run left in its logdir."""

import os

import numpy as np
import tensorflow as tf


def checkpoint_values(logdir) -> dict[str, np.ndarray]:
    """Every numeric tensor of the newest checkpoint in `logdir/checkpoints`, by checkpoint key."""
    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints"))
    out = {}
    for name, dtype in reader.get_variable_to_dtype_map().items():
        if dtype.is_floating or dtype.is_integer:
            out[name] = reader.get_tensor(name)
    return out
