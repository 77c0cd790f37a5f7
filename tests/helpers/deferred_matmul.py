"""L = sum(sin(x @ w)) (+ sum(w^2)) through `weight_gradients.matmul`, with `w` watched by a `WeightStash` or not:
the product, the tape's gradients, the stash's batched weight gradient and the traced graph's op types. Shared by
the deferred-matmul tests and the matmul-layout tests."""

from typing import Any

import tensorflow as tf

from gpipe_tf.layers import weight_gradients


def sin_loss_gradients(x: tf.Tensor, w: tf.Tensor, watched: bool = True, extra_use: bool = False) -> dict[str, Any]:
    """{'y', 'dx', 'dw' (the tape's; None where the stash holds it), 'batched_w' (the stash's X^T dY, None unless
    watched), 'weights' (the records' weight indices), 'ops' (op types of the traced step)}."""
    stash = weight_gradients.WeightStash()

    @tf.function(autograph=False)
    def run(x: tf.Tensor, w: tf.Tensor) -> dict[str, Any]:
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            if watched:
                with stash.watching([w]):
                    y = weight_gradients.matmul(x, w)
            else:
                y = weight_gradients.matmul(x, w)
            loss = tf.reduce_sum(tf.sin(y)) + (tf.reduce_sum(w * w) if extra_use else 0.0)
        dx, dw = tape.gradient(loss, [x, w])
        records = list(stash.records)
        stash.records.clear()
        batched_w = (weight_gradients.weight_gradient([r.x for r in records], [r.dy for r in records])
                     if records else None)
        return {"y": y, "dx": dx, "dw": dw, "batched_w": batched_w, "weights": [r.weight for r in records]}

    out = run(x, w)
    out["ops"] = {op.type for op in run.get_concrete_function(x, w).graph.get_operations()}
    return out
