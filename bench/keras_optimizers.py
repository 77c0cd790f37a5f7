"""Do Keras 3's optimizers fit the pipeline? Where they put their slots, and what a checkpoint restores.

Three float64 variables, one per logical CPU device (a 3-stage pipeline's placement), named 'stage<k>_w' (Keras'
Adafactor refuses the '/' of the project's names). Prints each optimizer's variables with their device, then saves
a Keras AdamW after 3 steps and restores it into a new AdamW built over the same variables listed in another order.
docs/experiments.md#why-the-optimizers-are-not-keras-3s quotes this output (keras 3.15, TF 2.21).

  python -m bench.keras_optimizers
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    """Prints the placement of AdamW, Adafactor and EMA slots and the out-of-order restore."""
    import numpy as np
    import tensorflow as tf

    from gpipe_tf import devices

    devices.split_cpu(3)
    import keras

    def make_variables() -> list[tf.Variable]:
        out = []
        for k in range(3):
            with tf.device(f"/device:CPU:{k}"):
                out.append(tf.Variable(np.full((2, 3), float(k)), name=f"stage{k}_w"))
        return out

    variables = make_variables()
    for name, optimizer in [("AdamW", keras.optimizers.AdamW(weight_decay=0.1)),
                            ("Adafactor", keras.optimizers.Adafactor()),
                            ("Adam(use_ema=True)", keras.optimizers.Adam(use_ema=True))]:
        optimizer.build(variables)
        slots = [f"{v.name}{list(v.shape)}@{v.value.device.rsplit('device:', 1)[1]}" for v in optimizer.variables
                 if v.name not in ("iteration", "learning_rate")]
        print(f"{name}: {', '.join(slots)}")

    saved = keras.optimizers.AdamW(weight_decay=0.1)
    saved.build(variables)
    for _ in range(3):
        saved.apply_gradients(zip([tf.ones_like(v) * (k + 1) for k, v in enumerate(variables)], variables))
    path = tf.train.Checkpoint(optimizer=saved).save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    print("AdamW checkpoint keys:", ", ".join(n for n, _ in tf.train.list_variables(path) if "OBJECT" not in n))
    fresh = make_variables()
    restored = keras.optimizers.AdamW(weight_decay=0.1)
    restored.build([fresh[2], fresh[0], fresh[1]])
    tf.train.Checkpoint(optimizer=restored).restore(path)
    by_name = {v.name: v for v in saved.variables}
    for var, original in zip(fresh, variables):
        momentum = next(v for v in restored.variables if v.name == f"{var.name[:-2]}_0_momentum")
        print(f"restored out of order: {var.name[:-2]} = {var.numpy()[0, 0]:.6f} (saved {original.numpy()[0, 0]:.6f}); "
              f"its momentum = {momentum.numpy()[0, 0]:.6f} (saved "
              f"{by_name[f'{var.name[:-2]}_0_momentum'].numpy()[0, 0]:.6f})")


if __name__ == "__main__":
    main()
