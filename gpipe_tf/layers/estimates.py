"""A layer's estimates from Params (`flops`, `output_spec`, `num_params`, `activation_bytes`, ...), each computed
once per layer and input spec inside `memoized()`.

A planner that tries hundreds of configurations of one model (the speed plan's search) asks the same layers about
the same micro-batch shapes again and again, and an AmoebaNet cell answers by walking its whole wiring. Inside
`memoized()`, `estimate` keys each answer by the layer's Params object (by identity: it must not change inside the
scope), the estimate's name and the input spec; outside, it simply calls the classmethod.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from gpipe_tf.hyperparams import InstantiableParams

_CACHE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("layer_estimates", default=None)


@contextlib.contextmanager
def memoized() -> Iterator[None]:
    """A scope in which `estimate` answers each (layer Params, estimate, input spec) once; nested scopes share the
    outermost one's answers. The layer Params asked about must not be changed inside it."""
    token = _CACHE.set({}) if _CACHE.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _CACHE.reset(token)


def estimate(lp: InstantiableParams, what: str, *args: Any) -> Any:
    """`lp.cls.<what>(lp, *args)`, memoized inside `memoized()` (see the module doc); its errors pass through."""
    compute = getattr(lp.cls, what)
    cache = _CACHE.get()
    if cache is None:
        return compute(lp, *args)
    key = (id(lp), what, repr(args))
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = (lp, compute(lp, *args))  # holding lp keeps its id from being reused inside the scope
    return hit[1]
