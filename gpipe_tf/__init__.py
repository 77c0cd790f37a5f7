"""gpipe_tf: a Lingvo-style TensorFlow 2 trainer with GPipe pipeline parallelism.

The package is split by concept, one per module or subpackage (docs/layout.md#package-layout): `hyperparams` (Params
trees), `errors` (errors a user can fix), `experiment` (knobs to one Params tree), `layers`, `gpipe` (the pipeline:
plan, placement, schedules), `memory` (will it fit?), `speed` (how fast?), `capacity` (the largest model per K),
`tasks`, `decoding` (greedy and beam search), `inputs`, `training` (the loop and what it writes), `inspection`
(--mode=inspect), `devices` (logical CPUs), `workers` (TF worker processes), `tpu_slices` (TPU cores per stage),
`tf_startup` (TensorFlow's quiet start) and `trainer_main` (the trainer program). The checkout's params/ and
model_registry/ folders are installed inside it as gpipe_tf.params and gpipe_tf.model_registry (setup.py).
Importing the package itself does not import TensorFlow, so tools that only read Params (the registry,
`--list_models`) start fast.
"""

__version__ = "0.1.0"
