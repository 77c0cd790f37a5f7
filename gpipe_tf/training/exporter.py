"""`--mode=export`: a SavedModel for serving, from a checkpoint of the run (the newest, or `--checkpoint`).

One serving signature, `serving_default`, per kind of task:

* classifiers (`ClassifierTask`): `inputs` (the input's features, any batch size) -> `logits`;
* translation (`TranslationTask`): `src_ids` (int32 [batch, length], padded with the vocabulary's pad id 0) ->
  `output_ids` (int32 [batch, max_length]): greedy search, tokens after the first EOS are EOS. The SentencePiece
  vocabulary is copied into the SavedModel's `assets/` so that ids can be turned back into text.

Pipelines are exported with their layers run in sequence, on one device, over the whole batch (`GPipe.
fprop_in_sequence`): the same layers and weights, so the same outputs up to float rounding, but no stages, no
micro-batches and no device names in the served graph. Serving then needs neither the training machine's devices
nor a batch size divisible by M, and the SavedModel loads with `tf.saved_model.load` in any TensorFlow process.
Translation decoding already runs un-pipelined (`TranslationTask.decode`), exactly as `--mode=decode` does.
Mixed precision is served as trained: weights cast to the compute dtype, logits in float32.

The SavedModel is written next to its target and renamed onto it (`partial_dir`): an interrupted export leaves no
half SavedModel, the next export removes the partial directories of killed ones, and a read-only directory or a
full disk is one ConfigError naming the target and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.hyperparams import Params
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.tasks.base_task import BaseTask
from gpipe_tf.tasks.classifier import ClassifierTask
from gpipe_tf.tasks.translation import TranslationTask
from gpipe_tf.training import checkpoints, partial_dir, weight_ema

EXPORT_DIR = "export"


def classifier_logits(task: ClassifierTask, inputs: tf.Tensor) -> tf.Tensor:
    """Inference logits of a classifier: its network (a pipeline's layers in sequence) then its softmax layer.

    Computed as evaluation computes them (`ClassifierTask.compute_loss`): weights as the forward pass reads them
    (`fprop_theta`: cast to the compute dtype under mixed precision), floating inputs cast to the compute dtype,
    logits in the variables' dtype (the softmax layer's rule), so a bfloat16 or float16 model serves the
    computation it was trained and evaluated with.
    """
    ctx = FPropContext(training=False)
    theta = task.fprop_theta
    inputs = task.to_fprop_dtype(inputs)
    network = task.network
    if isinstance(network, GPipe):
        features = network.fprop_in_sequence(theta["network"], inputs, ctx)
    else:
        features = network.fprop(theta["network"], inputs, ctx)
    return task.softmax.fprop(theta["softmax"], features, ctx)


class ClassifierServing(tf.Module):
    """The SavedModel root of a classifier: the task's variables and `serve(inputs) -> {'logits'}`."""

    def __init__(self, task: ClassifierTask, input_spec: tf.TensorSpec) -> None:
        super().__init__(name="classifier_serving")
        self.task = task
        self.serve = tf.function(lambda inputs: {"logits": classifier_logits(self.task, inputs)},
                                 autograph=False, input_signature=[input_spec])


class TranslationServing(tf.Module):
    """The SavedModel root of a translation task: variables, vocabulary asset, `serve(src_ids) -> {'output_ids'}`."""

    def __init__(self, task: TranslationTask, max_length: int, bos_id: int, eos_id: int, pad_id: int,
                 vocabulary_path: str | None) -> None:
        super().__init__(name="translation_serving")
        self.task = task
        if vocabulary_path:
            self.vocabulary = tf.saved_model.Asset(vocabulary_path)

        def translate(src_ids: tf.Tensor) -> dict[str, tf.Tensor]:
            paddings = tf.cast(tf.equal(src_ids, pad_id), self.task.dtype)
            ids = self.task.decode({"src_ids": src_ids, "src_paddings": paddings}, max_length, beam_size=1,
                                   bos_id=bos_id, eos_id=eos_id)
            return {"output_ids": ids}

        self.serve = tf.function(translate, autograph=False,
                                 input_signature=[tf.TensorSpec([None, None], tf.int32, name="src_ids")])


def _input_params(params: Params) -> Params:
    """The Params of the dataset whose features the signature takes: the first evaluation dataset, else train."""
    for name in list(params.eval.datasets) + ["train"]:
        if params.input.get(name) is not None:
            return params.input.get(name)
    raise ConfigError(f"{params.model} has no input Params to take the serving signature's shape from")


def serving_module(task: BaseTask, params: Params) -> tuple[tf.Module, str]:
    """The module to save for `task` and a note on its signature; ConfigError for other tasks."""
    if isinstance(task, TranslationTask):
        inp = _input_params(params).instantiate()
        vocab = inp.vocab
        max_length = params.eval.decode_max_length or inp.p.max_length
        module = TranslationServing(task, max_length, vocab.bos_id, vocab.eos_id, vocab.pad_id, vocab.model_path)
        return module, f"greedy search; src_ids padded with {vocab.pad_id}; vocabulary in assets/"
    if isinstance(task, ClassifierTask):
        spec = _input_params(params).instantiate().dataset().element_spec["inputs"]
        spec = tf.TensorSpec([None, *spec.shape[1:]], spec.dtype, name="inputs")
        pipelined = isinstance(task.network, GPipe)
        return ClassifierServing(task, spec), "inference mode" + (", pipeline layers in sequence" if pipelined else "")
    raise ConfigError(f"{params.model}'s task is a {type(task).__name__}; --mode=export knows ClassifierTask "
                      "(logits) and TranslationTask (greedy decoding)")


def export(task: BaseTask, params: Params, logdir: str, log: Callable[[str], None], checkpoint: str | None = None,
           export_dir: str | None = None) -> str:
    """Restores `checkpoint` (default: the newest in logdir) into `task` and writes its SavedModel to `export_dir`
    (default logdir/export/<step>); returns that directory. Never overwrites an existing export."""
    path, step = checkpoints.restore_task(task, logdir, checkpoint, log)
    if path is None:
        raise ConfigError(f"no checkpoint in {checkpoints.checkpoint_dir(logdir)} to export; check --logdir, train "
                          "first, or pass --checkpoint=PATH")
    weight_ema.maybe_use_averages(task, params.train, path, log)
    target = export_dir or os.path.join(logdir, EXPORT_DIR, str(step))
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ConfigError(f"{target} already exists; remove it or pass --export_dir=ANOTHER_DIR")
    module, note = serving_module(task, params)
    # Written next to the target and renamed (partial_dir): an interrupted export never leaves a half SavedModel
    # at `target`, and the next export removes what a killed one left.
    removed = partial_dir.write_atomically(
        target, lambda partial: tf.saved_model.save(module, partial, signatures={"serving_default": module.serve}),
        fix=f"free disk space or make {_existing_ancestor(target)} writable, or pass "
            "--export_dir=A_WRITABLE_DIRECTORY",
        clean_parent=export_dir is None)  # logdir/export holds only exports
    if removed:
        log(f"removed {len(removed)} partial export(s) of processes that ended: {', '.join(removed)}")
    log(f"exported {path} (step {step}) to {target}: serving_default {_shapes(module.serve)} ({note})")
    return target


def _existing_ancestor(path: str) -> str:
    """The nearest directory above `path` that exists: the one whose permissions decide whether it can be made."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent


def _shapes(function: tf.types.experimental.PolymorphicFunction) -> str:
    """`name [shape] -> name [shape]` of a signature function (None: any size)."""
    concrete = function.get_concrete_function()
    inputs = ", ".join(f"{spec.name} {spec.dtype.name} {spec.shape.as_list()}"
                       for spec in concrete.structured_input_signature[0])
    outputs = ", ".join(f"{name} {t.dtype.name} {t.shape.as_list()}" for name, t in concrete.structured_outputs.items())
    return f"{inputs} -> {outputs}"
