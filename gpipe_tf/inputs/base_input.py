"""Input generators: Params in, a `tf.data.Dataset` of batches (dicts of tensors) out."""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError


class BaseInput:
    """Base class of input generators.

    A training input repeats forever (`num_batches=None`); an evaluation input stops after `num_batches`.
    Datasets must be deterministic given `seed`, so that a checkpointed iterator resumes exactly.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: batch_size, seed, num_batches."""
        p = InstantiableParams(cls)
        p.define("batch_size", 32, "Examples per batch (the whole mini-batch, before micro-batching).")
        p.define("seed", 1, "Seed of this input's randomness (shuffling, sampling).")
        p.define("num_batches", None, "Batches before the dataset ends; None repeats forever (training).")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        self.p = params.copy().freeze()
        if self.p.batch_size <= 0:
            raise ParamsError(f"batch_size={self.p.batch_size} must be > 0")
        if self.p.num_batches is not None and self.p.num_batches <= 0:
            raise ParamsError(f"num_batches={self.p.num_batches} must be > 0 or None (repeat forever)")

    def dataset(self) -> tf.data.Dataset:
        """The dataset of batches: a dict of tensors per element, with a static batch dimension."""
        raise NotImplementedError(f"{type(self).__name__}.dataset")
