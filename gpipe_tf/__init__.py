"""gpipe_tf: a Lingvo-style TensorFlow 2 trainer with GPipe pipeline parallelism.

The package is split by concept (see README "Layout"): `hyperparams` (Params trees), `layers`, `tasks`,
`inputs`, `training` and `experiment`. Importing `gpipe_tf` itself does not import TensorFlow, so tools that only
read Params (the registry, `--list_models`) start fast.
"""

__version__ = "0.1.0"
