"""The operand layout of a dense layer's forward matmul on CPUs whose oneDNN kernels stop below AVX-512.

oneDNN's single-thread matmul of x [rows, in] by w [in, out] runs at about half its speed for 128 to 1023 rows
when its kernels are limited to AVX2 (a CPU without AVX-512, or `ONEDNN_MAX_CPU_ISA=AVX2`), while the same product
with w transposed (x times w^T as `transpose_b`) runs at full speed; with AVX-512 kernels the plain form is the
faster one. Measured on one machine, single thread, both ways (docs/benchmarks.md#forward-matmul-layout has the
command and its lines): AVX2 kernels, 256 rows, in 512, out 2048: 46 GFLOP/s plain, 65 GFLOP/s with the transpose
made per call; AVX-512 kernels: 100 and 91.

`forward(x, w)` returns x @ w for a 2-D x, taking the transposed form where `use_transposed` says so; its gradient
is the plain product's (dx = dy w^T, dw = x^T dy), so only the forward changes (`product` is the same ops for a
caller with a gradient of its own). The transposed copy of w is a weight-sized temporary. Where one graph holds
the forwards of several micro-batches reading the same weight tensor (`Unrolled`), TensorFlow merges their
transposes into one per step (a profile of the one-worker M=8 step shows about one transpose of every weight per
step), held until the last of those forwards: the step then holds a transposed copy of the stage's matmul weights
through its forward phase. A loop's body (`FillDrain`, the windowed loops) makes it once per iteration; where a
loop runs several iterations at once (the windowed loops, `loop_parts.host_loop`), inside `transposes_after_inputs`,
when the iteration's input is ready: made as the iteration starts, before the order lets its forward run, all M
iterations' copies were alive at once (1F1B's per-device peak at K=4, M=16 on workload (b) of docs/benchmarks.md
measured 3.3x higher with AVX2 kernels).
`EnsureShape` keeps Grappler from folding the transpose back into the matmul's flags (which would restore the slow
form; `Identity` does not keep it, `Snapshot` does but has no gradient for `vectorized_map` to differentiate).

`GPIPE_TF_MATMUL_LAYOUT` chooses: `auto` (default, the rule above), `plain` or `transposed` (everywhere on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import tensorflow as tf

LAYOUTS = ("auto", "plain", "transposed")
# The rows for which the transposed form measured faster with AVX2 kernels (docs/benchmarks.md).
TRANSPOSED_ROWS = range(128, 1024)
# oneDNN's ISA names that are AVX-512 or above (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA values).
_WIDE_ISA_PREFIXES = ("AVX512", "AVX10", "ALL", "DEFAULT")
_PLAIN = threading.local()  # .depth: how many `plain` blocks are open on this thread
_AFTER_INPUTS = threading.local()  # .depth: how many `transposes_after_inputs` blocks are open


@contextlib.contextmanager
def _open_block(local: threading.local) -> Iterator[None]:
    """Counts one more open block in `local.depth` while the block runs (blocks nest)."""
    local.depth = getattr(local, "depth", 0) + 1
    try:
        yield
    finally:
        local.depth -= 1


def plain() -> contextlib.AbstractContextManager[None]:
    """Within this block every forward takes the plain form, whatever the setting: for code that rebuilds the ops
    it is given (`tf.vectorized_map` turns the 2-D matmuls the rule was measured on into batched ones, and XLA
    cannot compile the gradient of a vectorized transpose)."""
    return _open_block(_PLAIN)


def layout_setting() -> str:
    """`GPIPE_TF_MATMUL_LAYOUT`, checked: one of LAYOUTS."""
    value = os.environ.get("GPIPE_TF_MATMUL_LAYOUT", "auto").strip().lower()
    if value not in LAYOUTS:
        raise ValueError(f"GPIPE_TF_MATMUL_LAYOUT={value!r} is not a layout; use one of {', '.join(LAYOUTS)} "
                         "(or unset it for auto)")
    return value


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:  # not Linux: no flags to read, and so no rule that depends on them
        return set()
    return set()


def onednn_below_avx512(environ: dict[str, str] | None = None, cpu_flags: set[str] | None = None) -> bool:
    """Whether TensorFlow's oneDNN kernels run here and are limited below AVX-512: oneDNN on
    (TF_ENABLE_ONEDNN_OPTS not 0) and either a cap (ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA below AVX512) or a CPU
    without avx512f. `environ` and `cpu_flags` default to this process's."""
    env = os.environ if environ is None else environ
    if env.get("TF_ENABLE_ONEDNN_OPTS", "1").strip().lower() in ("0", "false"):
        return False
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        cap = env.get(name, "").strip().upper()
        if cap and not cap.startswith(_WIDE_ISA_PREFIXES):
            return True
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    return bool(flags) and "avx512f" not in flags


@functools.lru_cache(maxsize=1)
def _below_avx512_here() -> bool:
    return onednn_below_avx512()


def use_transposed(rows: int | None, device: str, setting: str | None = None,
                   below_avx512: bool | None = None) -> bool:
    """Whether a forward matmul of `rows` rows placed on `device` (the device scope's string, '' if none) takes
    the transposed form: only on CPU (an accelerator's compiler picks its own layout), always with 'transposed',
    never with 'plain' or inside a `plain` block, and with 'auto' when oneDNN is below AVX-512 and `rows` is in
    TRANSPOSED_ROWS."""
    setting = layout_setting() if setting is None else setting
    if setting == "plain" or getattr(_PLAIN, "depth", 0) or "GPU" in device.upper() or "TPU" in device.upper():
        return False
    if setting == "transposed":
        return True
    below = _below_avx512_here() if below_avx512 is None else below_avx512
    return below and rows is not None and rows in TRANSPOSED_ROWS


def _takes_transposed(x: tf.Tensor) -> bool:
    """`use_transposed` for a forward of x: its rows, and the device its op was placed on or asked for ('' without
    a scope, where a machine with GPUs would place it on one)."""
    device = x.device or ("GPU" if tf.config.list_logical_devices("GPU") else "")
    return use_transposed(x.shape[0], device)


def transposes_after_inputs() -> contextlib.AbstractContextManager[None]:
    """Within this block a forward's transposed weight waits for the matmul's input: for a loop that runs several
    iterations at once, where a transpose that depends on the weight alone runs as soon as its iteration starts and
    each iteration in flight holds its copy until its forward."""
    return _open_block(_AFTER_INPUTS)


def transposed_weight(w: tf.Tensor, after: tf.Tensor | None = None) -> tf.Tensor:
    """w^T [out, in] as a tensor of its own: `EnsureShape` keeps Grappler from folding the transpose into the
    matmul that reads it (see the module doc). With `after` (the matmul's other operand) inside a
    `transposes_after_inputs` block, the transpose waits for it."""
    waits = after is not None and getattr(_AFTER_INPUTS, "depth", 0) > 0
    perm = [1, 0]
    if waits:
        # The transpose's inputs are made before the block: TensorFlow adds no control input to an op one of whose
        # inputs was made under the same dependencies (a w captured there, the permutation's constant).
        w, perm = tf.identity(w), tf.constant(perm)
    with tf.control_dependencies([after]) if waits else contextlib.nullcontext():
        return tf.ensure_shape(tf.transpose(w, perm), [w.shape[1], w.shape[0]])


def product(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """x [rows, in] @ w [in, out] in the layout the rule chooses, for a caller that defines the gradient itself
    (a `tf.custom_gradient`): the transposed form's ops have no gradient of their own here."""
    if _takes_transposed(x):
        return tf.matmul(x, transposed_weight(w, after=x), transpose_b=True)
    return tf.matmul(x, w)


def forward(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """x [rows, in] @ w [in, out] in the layout the rule chooses, with the plain product's gradient either way."""
    if _takes_transposed(x):
        return _transposed_product(x, w)
    return tf.matmul(x, w)


@tf.custom_gradient
def _transposed_product(x: tf.Tensor, w: tf.Tensor) -> tuple[tf.Tensor, object]:
    def grad(dy: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return tf.matmul(dy, w, transpose_b=True), tf.matmul(x, dy, transpose_a=True)

    return tf.matmul(x, transposed_weight(w, after=x), transpose_b=True), grad
