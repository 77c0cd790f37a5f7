"""The parts the while-loop schedules share (fill-drain's loop, `windowed_loop`'s), used by calling them.

Where things live, and why: `fill_drain.py`'s module doc. In short, the While op and its condition (the loop's
own iteration count) sit on this process's CPU, which runs no stage, so no stage has to answer before the next
micro-batch may start; each counter that indexes micro-batches starts on the stage that uses it, so what the
backward keeps of an index stays there.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from gpipe_tf.gpipe import placement
from gpipe_tf.gpipe.schedule_base import PipelineJob
from gpipe_tf.layers.base_layer import FPropContext


def counters(devices: Sequence[str]) -> list[tf.Tensor]:
    """One int32 zero per device in `devices`, made there: the loop counters of the stages that use them."""
    made = []
    for device in devices:
        with tf.device(device):
            made.append(tf.constant(0))
    return made


def next_micro_batch(job: PipelineJob, counter: tf.Tensor, micro: Any,
                     collect_aux: bool) -> tuple[tf.Tensor, tf.Tensor, Any, FPropContext]:
    """On the first stage: (its counter advanced, the micro-batch's index, micro-batch `counter` of the split inputs
    `micro`, that micro-batch's context). The seed comes from the first stage, which leads the forward pass."""
    with placement.on_stage(job.stage_scopes[0]):
        counter_next = counter + 1
        index = counter_next - 1
        inputs = tf.nest.map_structure(lambda t: t[index], micro)
        return counter_next, index, inputs, job.micro_batch_context(index, collect_aux)


def host_loop(body: Callable[..., tuple], loop_vars: tuple, num_micro_batches: int,
              parallel_iterations: int) -> Any:
    """`tf.while_loop(body, loop_vars)` for `num_micro_batches` iterations, the While op and its condition (its
    iteration count, `maximum_iterations`) on this process's CPU (`placement.host_device`)."""
    condition = placement.host_device()
    with tf.compat.v1.get_default_graph().device(placement.loop_device(condition, condition)):
        return tf.while_loop(lambda *_: True, body, loop_vars, maximum_iterations=num_micro_batches,
                             parallel_iterations=parallel_iterations)
