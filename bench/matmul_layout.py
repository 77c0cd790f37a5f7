"""The forward matmul's two operand layouts side by side, one thread: plain x @ w against x @ (w^T)^T with the
transpose made per call (what `gpipe_tf/layers/matmul_layout.py` chooses between).

For each shape [rows, in] x [in, out] of workload (a)'s projections and rows from 64 to 2048, prints GFLOP/s both
ways, medians of 5 timings of 10 products, and the layout the rule takes on this machine. Set the oneDNN caps
(e.g. `ONEDNN_MAX_CPU_ISA=AVX2`) before it to see the kernels of a CPU without AVX-512:

  python -m bench.matmul_layout
  ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m bench.matmul_layout
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# oneDNN kernels, as the trainer chooses them (gpipe_tf/trainer_main.py says why).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

SHAPES = ((512, 2048), (2048, 512), (512, 512))  # (in, out): FFN in, FFN out, attention projections
ROWS = (64, 128, 256, 512, 1024, 2048)
PRODUCTS = 10


def gflops(product: Callable, rows: int, in_dim: int, out_dim: int) -> float:
    """GFLOP/s of `product(x, w)` in a tf.function of PRODUCTS calls on fresh operands, median of 5 timings."""
    import tensorflow as tf

    x = tf.random.stateless_normal([rows, in_dim], [1, 2])
    w = tf.random.stateless_normal([in_dim, out_dim], [3, 4])

    @tf.function(autograph=False)
    def run(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        # Fresh operands per call, so that no product reuses another's work; the adds are 1/out and 1/rows of it.
        return tf.add_n([tf.reduce_sum(product(x + float(i), w + float(i))) for i in range(PRODUCTS)])

    run(x, w).numpy()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run(x, w).numpy()
        times.append(time.perf_counter() - start)
    return 2.0 * rows * in_dim * out_dim * PRODUCTS / statistics.median(times) / 1e9


def main() -> None:
    """Prints one line per shape and row count."""
    import tensorflow as tf

    from gpipe_tf.layers import matmul_layout

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    below = matmul_layout.onednn_below_avx512()
    print(f"oneDNN below AVX-512: {below}; layout setting: {matmul_layout.layout_setting()}")

    def transposed(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        return tf.matmul(x, matmul_layout.transposed_weight(w), transpose_b=True)

    for in_dim, out_dim in SHAPES:
        for rows in ROWS:
            plain_rate = gflops(tf.matmul, rows, in_dim, out_dim)
            transposed_rate = gflops(transposed, rows, in_dim, out_dim)
            chosen = "transposed" if matmul_layout.use_transposed(rows, "/device:CPU:0") else "plain"
            print(f"rows {rows:4d} in {in_dim:4d} out {out_dim:4d}: plain {plain_rate:6.1f} GFLOP/s, transposed "
                  f"{transposed_rate:6.1f} GFLOP/s; the rule takes {chosen}", flush=True)


if __name__ == "__main__":
    main()
