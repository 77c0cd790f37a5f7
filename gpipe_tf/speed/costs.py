"""What each chunk of a pipeline computes and sends per micro-batch, from Params alone.

A chunk's forward flops are its layers' `flops` on one micro-batch (the spec propagated through the layers by
their `output_spec`, as the plan's 'flops' balance does); the last chunk also runs the task's loss head
(`memory.head`) on each micro-batch's output. A chunk sends its output to the next chunk and receives that
output's gradient back, of the same size, in the compute dtype (integer tensors, e.g. token ids, keep theirs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.plan import StagePlan, micro_batch_spec
from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.layers.base_layer import spec_bytes
from gpipe_tf.layers.estimates import estimate
from gpipe_tf.memory.head import NO_HEAD, Head
from gpipe_tf.memory.stage import compute_spec


@dataclasses.dataclass(frozen=True)
class ChunkWork:
    """One chunk's work per micro-batch.

    Attributes:
      forward_flops: its layers' forward flops (and the loss head's, on the last chunk).
      params: the weights it holds (the head's included).
      output_bytes: the bytes of its output, sent to the next chunk (0 on the last chunk).
      input_bytes: the bytes of its input, whose gradient it sends back (0 on the first chunk).
    """

    forward_flops: float
    params: int
    output_bytes: int
    input_bytes: int


def boundary_bytes(spec: Any, compute_dtype: str) -> int:
    """Bytes of a (nested) TensorSpec sent between chunks: floating tensors in `compute_dtype`, integer ones (token
    ids) in their own."""
    return spec_bytes(compute_spec(spec, compute_dtype))


def _layer(lp: InstantiableParams, spec: Any, name: str) -> tuple[float, int, Any]:
    """(flops, params, output spec) of one layer on `spec`, or a ConfigError naming what it cannot say."""
    what = "flops"
    try:
        flops = float(estimate(lp, "flops", spec))
        what = "num_params"
        count = int(estimate(lp, "num_params"))
        what = "output_spec"
        return flops, count, estimate(lp, "output_spec", spec)
    except NotImplementedError:
        raise ConfigError(f"speed plan: {name} ({lp.cls.__name__}) cannot estimate its {what} from Params; "
                          f"implement {lp.cls.__name__}.{what}") from None


def chunk_work(pipe: InstantiableParams, plan: StagePlan, compute_dtype: str, head: Head = NO_HEAD,
               path: str = "task.network") -> list[ChunkWork]:
    """Each chunk's `ChunkWork` for the GPipe Params `pipe` split by `plan`, its loss `head` on the last chunk."""
    layers = list(pipe.layers)
    spec = compute_spec(micro_batch_spec(pipe, path), compute_dtype)
    out = []
    for c in range(plan.num_chunks):
        input_bytes = 0 if c == 0 else boundary_bytes(spec, compute_dtype)
        flops, params = 0.0, 0
        for j in plan.layer_indices(c):
            f, n, spec = _layer(layers[j], spec, f"{path}.layer_{j}")
            flops, params = flops + f, params + n
        last = c == plan.num_chunks - 1
        if last:
            features = spec
            for name, lp in head.layers:
                f, n, features = _layer(lp, features, name)
                flops, params = flops + f, params + n
        out.append(ChunkWork(flops, params, 0 if last else boundary_bytes(spec, compute_dtype), input_bytes))
    return out
