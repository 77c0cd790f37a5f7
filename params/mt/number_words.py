"""A small pipelined Transformer translating spelled-out numbers between 10 languages (many-to-many)."""

from __future__ import annotations

import os
import tempfile

from gpipe_tf import model_registry
from gpipe_tf.experiment import Experiment
from gpipe_tf.hyperparams import InstantiableParams, Params


def default_vocab_dir() -> str:
    """A fixed cache folder for the trained vocabulary, shared by runs (its file name encodes the setting)."""
    return os.path.join(tempfile.gettempdir(), "gpipe_tf_vocab")


@model_registry.register
class NumbersTiny(Experiment):
    """2+2-layer Transformer (d=128) in a 2-stage GPipe over 4 micro-batches on 4 logical CPU devices."""

    max_number = 5000
    vocab_size = 1000
    max_length = 16
    vocab_dir = ""  # empty: default_vocab_dir()
    model_dim = 128
    num_heads = 4
    hidden_dim = 256
    num_encoder_layers = 2
    num_decoder_layers = 2
    share_embeddings = True  # one source/target embedding table (the languages share one vocabulary)
    dropout_rate = 0.1
    label_smoothing = 0.1
    batch_size = 64
    learning_rate = 2e-3
    warmup_steps = 100
    max_steps = 3000
    dtype = "float32"
    num_stages = 2
    num_micro_batches = 4
    remat = "never"
    schedule = "fill_drain"  # a name from gpipe_tf.gpipe.schedules.SCHEDULES, or a schedule's Params
    logical_devices = 4

    def task(self) -> InstantiableParams:
        """The TranslationTask with this experiment's sizes and pipeline settings."""
        from gpipe_tf.gpipe.pipeline import schedule_params
        from gpipe_tf.tasks.translation import TranslationTask

        p = TranslationTask.params().set(
            name="translation", dtype=self.dtype, vocab_size=self.vocab_size, model_dim=self.model_dim,
            num_heads=self.num_heads, hidden_dim=self.hidden_dim, num_encoder_layers=self.num_encoder_layers,
            num_decoder_layers=self.num_decoder_layers, share_embeddings=self.share_embeddings,
            dropout_rate=self.dropout_rate, label_smoothing=self.label_smoothing)
        # Spelled out in the tree, the pipeline's only home, so that inspect and --params
        # (task.network.num_stages=...) see it.
        p.network = TranslationTask.network_params(
            p, num_stages=self.num_stages, num_micro_batches=self.num_micro_batches, remat=self.remat,
            schedule=schedule_params(self.schedule))
        # The longest micro-batch the inputs give (src ids, src paddings, tgt ids, tgt paddings: the network's
        # 4-tuple the translation task feeds it), so that the memory planner needs no flag to size it.
        shape = [self.batch_size // self.num_micro_batches, self.max_length]
        p.network.set(micro_batch_shape=[shape] * 4, input_dtype=["int32", "float32", "int32", "float32"])
        return p

    def _input(self, split: str, num_batches: int | None) -> InstantiableParams:
        from gpipe_tf.inputs.translation_input import NumbersTranslationInput

        return NumbersTranslationInput.params().set(
            split=split, max_number=self.max_number, vocab_size=self.vocab_size, max_length=self.max_length,
            vocab_dir=self.vocab_dir or default_vocab_dir(), batch_size=self.batch_size, num_batches=num_batches)

    def train_input(self) -> InstantiableParams:
        """Shuffled training batches, repeated forever."""
        return self._input("train", None)

    def dev_input(self) -> InstantiableParams:
        """The first 10 dev batches, in corpus order."""
        return self._input("dev", 10)

    def test_input(self) -> InstantiableParams:
        """The first 10 test batches, in corpus order."""
        return self._input("test", 10)

    def training(self) -> Params:
        """Adam with linear warm-up then 1/sqrt decay (peak = learning_rate), gradient clipping."""
        from gpipe_tf.training.lr_schedules import LinearWarmupRsqrtDecay
        from gpipe_tf.training.optimizers import Adam

        p = super().training()
        p.set(max_steps=self.max_steps, learning_rate=self.learning_rate, clip_gradient_norm=1.0,
              summary_interval_steps=10, log_interval_steps=25, save_interval_steps=100)
        p.optimizer = Adam.params()
        p.lr_schedule = LinearWarmupRsqrtDecay.params().set(warmup_steps=self.warmup_steps)
        return p
