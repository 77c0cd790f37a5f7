"""The base layer: a `tf.Module` built from Params, with an explicit-weights forward pass.

Every layer follows one contract, so that the pipeline can re-run any layer on any device:

* `Layer.params()` returns the layer's default `InstantiableParams`; `p.instantiate()` builds it.
* Variables are created in `__init__` (never lazily), from Params-described initializers with seeds derived
  from the layer's seed and the variable's name: two builds of the same Params start identical.
* Children are built from child Params; `dtype`, `fprop_dtype` and `seed` flow down when the child leaves them
  unset.
* `fprop(theta, inputs, ctx)` is pure: it reads weights only from `theta` (a nested dict of tensors or
  variables mirroring the layer tree) and randomness only from `ctx.seed`. Passing weights explicitly is
  what lets `tf.recompute_grad` and `tf.while_loop` schedules re-run a layer (closures over variables fail
  there: measured with TF 2.21).

Mixed precision (Lingvo's split of `fprop_dtype` from the variable `dtype`): variables are created in `dtype`
(float32), the forward pass computes in `fprop_dtype` (bfloat16 or float16). Whoever hands a layer its weights
casts them once with `cast_theta` (`fprop_theta` for the layer's own variables): the cast is part of the
differentiated computation, so gradients arrive in the variables' dtype. Layers whose numerics need it keep some
variables uncast (`UNCAST_VARIABLES`: norms' scales and statistics, embedding tables, which cast the rows they
gather) and compute their sensitive parts in float32 (softmax, norm statistics, losses).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, Params, ParamsError
from gpipe_tf.layers import initializers, stateless_random

DEFAULT_SEED = 1234
DTYPES = ("float32", "float64", "bfloat16", "float16")
HALF_DTYPES = (tf.float16, tf.bfloat16)


@dataclasses.dataclass(frozen=True)
class FPropContext:
    """What a forward pass needs besides weights and inputs.

    Attributes:
      training: True in training (dropout on, batch norm on batch statistics).
      seed: a stateless RNG seed, int tensor of shape [2], for this forward pass (e.g. from the step and the
        micro-batch index). Each random layer folds in its own `random_id`, so masks depend on (seed, layer)
        only: recomputation repeats them and the pipeline partition does not change them.
      aux: None, or a dict that layers fill with per-step statistics (batch norm: sum, sum of squares and
        count of its inputs, keyed by layer path). Statistics leave the forward pass this way, not by
        updating variables, so that recomputation cannot apply them twice; the learner applies them once
        per step (`BaseLayer.apply_aux_stats`).
      loss_scale: None, or the float32 scalar the training step multiplies its loss by (mixed-precision loss
        scaling); schedules that run the backward pass inside the pipeline (1F1B) start it from this scale.
    """

    training: bool = False
    seed: Any = None
    aux: dict | None = None
    loss_scale: Any = None

    def layer_seed(self, random_id: int, layer_path: str) -> tf.Tensor:
        """The stateless seed for one layer: `seed` with the layer's id folded in."""
        if self.seed is None:
            raise ValueError(
                f"layer {layer_path!r} draws random numbers in training but FPropContext.seed is None; "
                "pass FPropContext(training=True, seed=<int tensor [2]>)")
        return stateless_random.fold_in(tf.convert_to_tensor(self.seed), random_id)


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class BaseLayer(tf.Module):
    """Base class of all layers: Params in, variables built in `__init__`, pure `fprop`."""

    # Names of this class's variables that `cast_theta` leaves in their own dtype under mixed precision.
    UNCAST_VARIABLES: frozenset[str] = frozenset()

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params of this layer class; subclasses extend them."""
        p = InstantiableParams(cls)
        p.define("name", "", "Layer name, the last part of its variables' names. Empty: class name in snake case.")
        p.define("dtype", None, f"Variable dtype, one of {DTYPES}. None: the parent's (root: float32).")
        p.define("fprop_dtype", None, f"dtype of the forward computation and the activations, one of {DTYPES}; "
                 "'bfloat16' or 'float16' with float32 variables is mixed precision (docs/precision.md). "
                 "None: the parent's (root: dtype).")
        p.define("seed", None, "Seed of the variable initializers. None: derived from the parent's seed and this "
                 f"layer's name (root: {DEFAULT_SEED}).")
        p.define("params_init", initializers.weight_init(), "Initializer of this layer's weight matrices.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        if not isinstance(params, InstantiableParams):
            raise ParamsError(f"{type(self).__name__} expects InstantiableParams from "
                              f"{type(self).__name__}.params(), got {type(params).__name__}")
        p = params.copy()
        if not p.name:
            p.name = _snake_case(type(self).__name__)
        if p.dtype is None:
            p.dtype = "float32"
        if p.dtype not in DTYPES:
            raise ParamsError(f"{p.name}.dtype={p.dtype!r} is not supported; use one of {DTYPES}")
        if p.fprop_dtype is None:
            p.fprop_dtype = p.dtype
        if p.fprop_dtype not in DTYPES:
            raise ParamsError(f"{p.name}.fprop_dtype={p.fprop_dtype!r} is not supported; use one of {DTYPES} "
                              "(or None: the variables' dtype)")
        self.path = f"{parent_path}/{p.name}" if parent_path else p.name
        if p.seed is None:
            p.seed = initializers.derive_seed(DEFAULT_SEED, self.path)
        super().__init__(name=re.sub(r"\W", "_", p.name))
        self._params = p.freeze()
        # Plain dicts assigned to a tf.Module are tracked for checkpoints under these attribute names.
        self.vars: dict[str, tf.Variable] = {}
        self.children: dict[str, BaseLayer] = {}

    @property
    def p(self) -> InstantiableParams:
        """This layer's frozen, resolved Params."""
        return self._params

    @property
    def dtype(self) -> tf.DType:
        """The dtype of the layer's variables."""
        return tf.as_dtype(self.p.dtype)

    @property
    def fprop_dtype(self) -> tf.DType:
        """The dtype the layer computes in and its activations have (the variables' dtype unless mixed precision)."""
        return tf.as_dtype(self.p.fprop_dtype)

    @property
    def random_id(self) -> int:
        """A stable id for stateless randomness, from the layer's path (independent of device placement)."""
        return initializers.derive_seed("random", self.path)

    def create_child(self, name: str, params: InstantiableParams) -> BaseLayer:
        """Builds a child layer from `params`, passing down dtype and a derived seed; returns it."""
        if name in self.children:
            raise ParamsError(f"layer {self.path!r} already has a child named {name!r}")
        cp = params.copy()
        if "name" in cp and not cp.name:
            cp.name = name
        if "dtype" in cp and "fprop_dtype" in cp:
            cp.dtype, cp.fprop_dtype = inherited_dtypes(cp, self.p.dtype, self.p.fprop_dtype)
        elif "dtype" in cp and cp.dtype is None:
            cp.dtype = self.p.dtype
        if "seed" in cp and cp.seed is None:
            cp.seed = initializers.derive_seed(self.p.seed, name)
        child = cp.instantiate(parent_path=self.path)
        self.children[name] = child
        return child

    def create_children(self, name: str, params_list: list[InstantiableParams]) -> list[BaseLayer]:
        """Builds a list of children named `name_0`, `name_1`, ...; returns them in order."""
        return [self.create_child(f"{name}_{i}", cp) for i, cp in enumerate(params_list)]

    def create_variable(self, name: str, shape: list[int], init: Params | None = None,
                        trainable: bool = True, dtype: tf.DType | None = None) -> tf.Variable:
        """Creates a variable from initializer Params (default: `p.params_init`) with a deterministic seed."""
        if name in self.vars:
            raise ParamsError(f"layer {self.path!r} already has a variable named {name!r}")
        init = init if init is not None else self.p.params_init
        seed = initializers.derive_seed(self.p.seed, name)
        value = initializers.initial_value(init, shape, dtype or self.dtype, seed)
        var = tf.Variable(value, trainable=trainable, name=f"{self.path}/{name}")
        self.vars[name] = var
        return var

    @property
    def theta(self) -> dict[str, Any]:
        """This layer's weights as a nested dict: own variables plus one entry per child."""
        theta: dict[str, Any] = dict(self.vars)
        for name, child in self.children.items():
            theta[name] = child.theta
        return theta

    def cast_theta(self, theta: Mapping[str, Any]) -> dict[str, Any]:
        """`theta` as the forward pass reads it: floating weights in `fprop_dtype`, children's recursively.

        Variables named in `UNCAST_VARIABLES` stay in their dtype. Without mixed precision nothing is cast. The
        cast is differentiated with the rest, so gradients come back in the variables' dtype.
        """
        out = dict(theta)
        for name, child in self.children.items():
            if name in out:
                out[name] = child.cast_theta(out[name])
        if self.fprop_dtype != self.dtype:
            for name in self.vars:
                value = out.get(name)
                if (name not in self.UNCAST_VARIABLES and value is not None and value.dtype.is_floating
                        and value.dtype != self.fprop_dtype):
                    out[name] = tf.cast(value, self.fprop_dtype)
        return out

    @property
    def fprop_theta(self) -> dict[str, Any]:
        """This layer's weights as its forward pass reads them: `cast_theta(theta)`."""
        return self.cast_theta(self.theta)

    def to_fprop_dtype(self, structure: Any) -> Any:
        """`structure` with its floating-point leaves cast to `fprop_dtype` (integer ids and labels unchanged)."""
        return tf.nest.map_structure(
            lambda t: tf.cast(t, self.fprop_dtype) if tf.as_dtype(t.dtype).is_floating else t, structure)

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """The forward pass; subclasses implement it reading weights only from `theta`."""
        raise NotImplementedError(f"{type(self).__name__}.fprop")

    def __call__(self, inputs: Any, ctx: FPropContext | None = None) -> Any:
        """Runs `fprop` with this layer's own variables (and, in mixed precision, floating inputs) cast for it."""
        if self.fprop_dtype != self.dtype:
            inputs = self.to_fprop_dtype(inputs)
        return self.fprop(self.fprop_theta, inputs, ctx or FPropContext())

    def aux_stats_spec(self) -> dict[str, Any]:
        """TensorSpecs of the statistics this layer and its children put in `ctx.aux` in training, by path."""
        spec: dict[str, Any] = {}
        for child in self.children.values():
            spec.update(child.aux_stats_spec())
        return spec

    def apply_aux_stats(self, aux: Mapping[str, Any]) -> None:
        """Applies once-per-step statistics from `ctx.aux` (e.g. batch norm moving averages); default: none."""

    def set_training_step(self, step: tf.Tensor) -> None:
        """Called by the learner before each step for layers whose behaviour ramps with training (drop path)."""

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Number of trainable parameters, computed from Params alone (no variables are created).

        Layers whose size is known from their Params override this; the default builds nothing and says so.
        """
        raise NotImplementedError(f"{cls.__name__}.num_params is not implemented")

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> Any:
        """The output's `tf.TensorSpec` structure for `input_spec`, from Params alone."""
        raise NotImplementedError(f"{cls.__name__}.output_spec is not implemented")

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """Estimated forward flops for one call on `input_spec`, from Params alone."""
        raise NotImplementedError(f"{cls.__name__}.flops is not implemented")

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """Bytes one training forward call on `input_spec` keeps alive for its backward pass, from Params alone.

        Counts the tensors the call creates that TensorFlow's gradient reads, its output included (the next
        layer's gradient reads it), at the dtypes of the specs (the compute dtype); not the input's own tensors
        (whoever made them counts them). A layer that cannot say raises NotImplementedError naming itself and
        what is missing; `memory/` turns that into the planner's error.
        """
        raise NotImplementedError(f"{cls.__name__}.activation_bytes is not implemented (the layer cannot say "
                                  "which tensors its backward pass keeps)")

    @classmethod
    def loss_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """Bytes this layer's work holds at once when a task runs it as its loss head (forward and backward in one
        go, `memory/head.py`), from Params alone: by default what it keeps and the gradient of as much."""
        return 2 * cls.activation_bytes(p, input_spec)

    @classmethod
    def scratch_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """Scratch memory the largest single op of this layer's backward pass allocates beside its tensors (a
        kernel's workspace), from Params alone; 0 unless a layer says otherwise."""
        return 0


def sensitive_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype for numerically sensitive work (softmax, norm statistics, losses): float32 for half precision."""
    dtype = tf.as_dtype(dtype)
    return tf.float32 if dtype in HALF_DTYPES else dtype


def fprop_dtype_of(p: InstantiableParams) -> str:
    """The compute dtype that Params describe, for Params-only output specs: fprop_dtype, else dtype, else float32."""
    return p.fprop_dtype or p.dtype or "float32"


def inherited_dtypes(p: Params, dtype: str = "float32", fprop_dtype: str = "float32") -> tuple[str, str]:
    """(dtype, fprop_dtype) of the layer that Params `p` build as the child of a layer with `dtype` and
    `fprop_dtype` (a root's parent: float32): its own where it sets them; else its parent's variable dtype, and its
    parent's compute dtype when their variable dtypes agree (a child that keeps its own variable dtype computes in
    it unless told otherwise)."""
    own = p.dtype or dtype
    return own, p.fprop_dtype or (fprop_dtype if own == dtype else own)


def with_inherited_dtypes(p: InstantiableParams, dtype: str = "float32",
                          fprop_dtype: str = "float32") -> InstantiableParams:
    """A copy of the layer Params `p`, built under a parent with `dtype` and `fprop_dtype`, in which it and every
    layer below it state the dtypes they will be built with (`inherited_dtypes`): what Params-only planners read
    (`fprop_dtype_of`) is then what the built layers compute in."""
    out = p.copy()
    pending = [(out, dtype, fprop_dtype)]
    while pending:
        node, parent_dtype, parent_fprop = pending.pop()
        node.dtype, node.fprop_dtype = inherited_dtypes(node, parent_dtype, parent_fprop)
        pending.extend((child, node.dtype, node.fprop_dtype) for child in _child_layers(node))
    return out


def count_params(p: InstantiableParams) -> int:
    """Trainable parameters of a layer or task from its Params alone: its own count, or the sum over its child
    layer Params when its class cannot count them (`num_params` raises NotImplementedError)."""
    try:
        return int(p.cls.num_params(p))
    except NotImplementedError:
        return sum(count_params(c) for c in _child_layers(p))


def _child_layers(p: Params) -> list[InstantiableParams]:
    """The layer Params among `p`'s values, in lists and tuples too."""
    out = []
    for _, value in p.items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, InstantiableParams) and isinstance(item.cls, type) and issubclass(item.cls,
                                                                                                  BaseLayer):
                out.append(item)
    return out


def num_elements(spec: tf.TensorSpec) -> int:
    """Elements of a fully defined TensorSpec (flops estimates need static shapes)."""
    if not spec.shape.is_fully_defined():
        raise ParamsError(f"cost estimates need a fully defined input shape, got {spec.shape}")
    return int(spec.shape.num_elements())


def spec_bytes(spec: Any) -> int:
    """Bytes of every tensor in a (nested) TensorSpec structure; None leaves count 0 (e.g. an absent mask)."""
    total = 0
    for leaf in tf.nest.flatten(spec):
        if leaf is not None:
            total += num_elements(leaf) * tf.as_dtype(leaf.dtype).size
    return total


def elements_bytes(spec: tf.TensorSpec, dtype: Any = None) -> int:
    """Bytes of a tensor of `spec`'s shape in `dtype` (default: the spec's dtype)."""
    return num_elements(spec) * tf.as_dtype(dtype or spec.dtype).size
