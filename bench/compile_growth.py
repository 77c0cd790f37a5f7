"""Trace + compile cost of a deep pipeline at growing M: the figure that decides which schedule scales.

A 24-layer Transformer stack at toy width (d_model 64, 4 heads, FFN 256, sequence 16, batch 64), K=4 on 4 logical
CPUs, remat always. For each M, the time to trace, compile and run the first training step, and the next step. The
loss (the mean square of the output) is handed to the pipeline (`GPipe.fprop_with_loss`), so the schedules whose
loss runs inside their loop (1F1B, Interleaved, the zero-bubble ones) are measured with that loop.

  python -m bench.compile_growth                          # fill_drain at M=4 and M=32
  python -m bench.compile_growth --schedule unrolled --m 4  # the unrolled schedule (minutes, growing with M)
  python -m bench.compile_growth --schedule zero_bubble_v   # any schedule by its short name
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def measure(schedule: str, m: int) -> tuple[float, float]:
    """(trace + compile + first step, next step) in seconds."""
    import tensorflow as tf

    from gpipe_tf.gpipe.pipeline import GPipe
    from gpipe_tf.gpipe.schedule_base import PipelineLoss
    from gpipe_tf.layers.base_layer import FPropContext
    from gpipe_tf.layers.transformer import TransformerEncoderLayer

    layers = [TransformerEncoderLayer.params().set(model_dim=64, num_heads=4, hidden_dim=256) for _ in range(24)]
    pipe = GPipe.params().set(name=f"net_m{m}", layers=layers, num_stages=4, num_micro_batches=m, remat="always",
                              devices=[f"/device:CPU:{i}" for i in range(4)], schedule=schedule).instantiate()
    ctx = FPropContext(training=True)

    def squares(head: list, out: tf.Tensor, targets: dict, ctx: FPropContext) -> dict:
        return {"loss": tf.reduce_sum(tf.square(out)) * targets["scale"][0]}

    x = tf.random.stateless_normal([64, 16, 64], [1, 2])
    size = float(x.shape.num_elements())

    @tf.function(autograph=False)
    def step(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            head = PipelineLoss(squares, (), {"scale": tf.ones([x.shape[0]])}, tf.constant(1.0 / size))
            loss = pipe.fprop_with_loss(pipe.theta, x, head, ctx)["loss"] / size
        grads = tape.gradient(loss, pipe.trainable_variables)
        return loss + 0.0 * tf.add_n([tf.reduce_sum(g) for g in grads])

    start = time.perf_counter()
    step(x).numpy()
    first = time.perf_counter() - start
    start = time.perf_counter()
    step(x).numpy()
    return first, time.perf_counter() - start


def main() -> None:
    """Prints one line per M and the growth of the first-step time from the smallest to the largest M."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="fill_drain", help="GPipe schedule by short name (fill_drain, "
                        "unrolled, one_f_one_b, interleaved, zero_bubble, zero_bubble_v)")
    parser.add_argument("--m", type=int, nargs="+", default=[4, 32], help="micro-batch counts to measure")
    args = parser.parse_args()
    from gpipe_tf import devices
    devices.split_cpu(4)
    firsts = []
    for m in args.m:
        first, step = measure(args.schedule, m)
        firsts.append(first)
        print(f"schedule={args.schedule} K=4 M={m}: trace + compile + first step {first:.1f} s, next step "
              f"{step:.2f} s", flush=True)
    if len(firsts) > 1:
        print(f"compile growth M={args.m[-1]}/M={args.m[0]} ({args.schedule}): {firsts[-1] / firsts[0]:.2f}")


if __name__ == "__main__":
    main()
