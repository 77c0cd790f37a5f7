"""An MLP classifier on generated Gaussian-mixture data: learns in seconds on a CPU, needs no download."""

from __future__ import annotations

from gpipe_tf import model_registry
from gpipe_tf.experiment import Experiment
from gpipe_tf.hyperparams import InstantiableParams, Params, ParamsError


@model_registry.register
class BlobsMlp(Experiment):
    """16-D points from 8 classes x 3 Gaussian clusters, classified by a small ReLU MLP with dropout."""

    input_dim = 16
    num_classes = 8
    hidden_dims = (64, 64)
    dropout_rate = 0.1
    batch_size = 64
    learning_rate = 3e-3
    max_steps = 300
    dtype = "float32"
    num_stages = 1
    num_micro_batches = 1
    remat = "never"
    schedule = "fill_drain"  # a name from gpipe_tf.gpipe.schedules.SCHEDULES, or a schedule's Params

    def task(self) -> InstantiableParams:
        """An MLP body (Linear+ReLU+Dropout per hidden layer) and a softmax."""
        from gpipe_tf.gpipe.pipeline import FillDrain, GPipe, schedule_params
        from gpipe_tf.layers.dropout import Dropout
        from gpipe_tf.layers.linear import Linear
        from gpipe_tf.layers.sequential import Sequential
        from gpipe_tf.tasks.classifier import ClassifierTask

        layers = []
        dims = [self.input_dim, *self.hidden_dims]
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(Linear.params().set(name=f"fc{i}", input_dim=d_in, output_dim=d_out, activation="relu"))
            layers.append(Dropout.params().set(name=f"dropout{i}", rate=self.dropout_rate))
        p = ClassifierTask.params().set(name="classifier", dtype=self.dtype)
        schedule = schedule_params(self.schedule, type(self).__name__)
        if self.num_stages == 1 and self.num_micro_batches == 1:
            if schedule.cls is not FillDrain:
                raise ParamsError(f"{type(self).__name__}.schedule={self.schedule!r} needs a pipeline: set num_stages "
                                  "or num_micro_batches above 1 (e.g. toy.classifier.BlobsMlpGPipe)")
            p.network = Sequential.params().set(layers=layers)
        else:
            p.network = GPipe.params().set(
                layers=layers, num_stages=self.num_stages, num_micro_batches=self.num_micro_batches, remat=self.remat,
                micro_batch_shape=[self.batch_size // self.num_micro_batches, self.input_dim], input_dtype=self.dtype,
                schedule=schedule)
        p.softmax.set(input_dim=dims[-1], num_classes=self.num_classes)
        return p

    def _input(self, seed: int, num_batches: int | None) -> InstantiableParams:
        from gpipe_tf.inputs.synthetic import GaussianMixtureInput

        return GaussianMixtureInput.params().set(
            input_dim=self.input_dim, num_classes=self.num_classes, batch_size=self.batch_size, seed=seed,
            num_batches=num_batches, dtype=self.dtype)

    def train_input(self) -> InstantiableParams:
        """An endless stream of generated training batches."""
        return self._input(seed=1, num_batches=None)

    def dev_input(self) -> InstantiableParams:
        """20 batches drawn with another seed (same mixture)."""
        return self._input(seed=2, num_batches=20)

    def test_input(self) -> InstantiableParams:
        """20 more batches with a third seed."""
        return self._input(seed=3, num_batches=20)

    def training(self) -> Params:
        """Adam at a constant learning rate; checkpoints every 100 steps."""
        p = super().training()
        p.set(max_steps=self.max_steps, learning_rate=self.learning_rate, summary_interval_steps=10,
              log_interval_steps=50, save_interval_steps=100)
        return p


@model_registry.register
class BlobsMlpGPipe(BlobsMlp):
    """The same classifier as a 2-stage GPipe pipeline over 4 micro-batches on 2 logical CPU devices."""

    hidden_dims = (64, 64, 64)
    num_stages = 2
    num_micro_batches = 4
    remat = "always"
    logical_devices = 2
