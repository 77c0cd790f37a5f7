"""`train.seed`, the run seed: one number that reproduces a run's initialization, data order and dropout.

* dropout (and every random layer in training): step s draws from the stateless seed (train.seed, s);
* initialization: `task.seed` (the root of every layer's initializer seed);
* training data order: `input.train.seed`.

With train.seed=1 (the default) the experiment's own task.seed and input.train.seed are used as they are. Any
other value derives both from the experiment's value and train.seed, so changing train.seed alone changes all
three. A seed set explicitly with --params (e.g. `task.seed=7`) is kept as given. The evaluation datasets (dev,
test) never change with train.seed: runs with different seeds are evaluated on the same examples.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from gpipe_tf.hyperparams import Params, ParamsError

DEFAULT_RUN_SEED = 1
# The seeds train.seed drives, and the root seed a task uses when its seed is None (base_layer.DEFAULT_SEED).
DERIVED = ("task.seed", "input.train.seed")
_TASK_DEFAULT_SEED = 1234


def derive(run_seed: int, field: str, base: int | None) -> int:
    """The value of seed `field` for run seed `run_seed` given the experiment's value `base` (a 31-bit int)."""
    if base is None:
        base = _TASK_DEFAULT_SEED
    return zlib.crc32(f"{field}/{base}/{run_seed}".encode()) & 0x7FFFFFFF


def apply(params: Params, explicit: Iterable[str]) -> None:
    """Derives the DERIVED seeds of unfrozen `params` from train.seed, except those in `explicit` (keys set by
    --params); nothing to do when train.seed is the default or a field is absent."""
    if "train.seed" not in params:
        return
    run_seed = params.get("train.seed")
    if isinstance(run_seed, bool) or not isinstance(run_seed, int):
        raise ParamsError(f"train.seed={run_seed!r} must be an int, e.g. --params=train.seed=3")
    if run_seed == DEFAULT_RUN_SEED:
        return
    explicit = set(explicit)
    for field in DERIVED:
        if field in params and field not in explicit:
            parent, name = field.rsplit(".", 1)
            params.get(parent).set(**{name: derive(run_seed, field, params.get(field))})
