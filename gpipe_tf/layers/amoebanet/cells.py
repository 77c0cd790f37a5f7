"""An AmoebaNet cell built from a genotype table: (h[i-1], h[i-2]) in, (h[i], h[i-1]) out.

Input plumbing (paper_facts §3): state 0 is ReLU -> 1x1 -> BN of h[i-1]. State 1 is h[i-2] adjusted to h[i-1]'s
grid and fs channels: ReLU + factorized reduction when it is twice as large, ReLU -> 1x1 -> BN when only the
channels differ, unchanged otherwise; a cell without h[i-2] (the first cell after the stem) uses the raw h[i-1].
In a reduction cell, operations reading states 0 or 1 have stride 2 and those reading block outputs stride 1.
A concatenated input state whose channels or grid differ from the blocks' (only the raw h[i-1] in practice) is
brought to fs channels by a 1x1 conv + BN, or by a factorized reduction in a reduction cell.

The wiring is written once (`_wire`) and interpreted three ways: on tensors (fprop), on TensorSpecs (output_spec)
and on TensorSpecs while adding up flops, so the cost model cannot drift from the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.amoebanet.conv import ConvScratch
from gpipe_tf.layers.amoebanet.drop_path import DropPath
from gpipe_tf.layers.amoebanet.genotypes import cell_genotype
from gpipe_tf.layers.amoebanet.ops import ReluConvBN, op_params
from gpipe_tf.layers.amoebanet.reduction import FactorizedReduction
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements

SKIP_MODES = ("none", "same", "reduce")


class Cell(ConvScratch, BaseLayer):
    """A normal or reduction cell of genotype A, B or D with `filters` (fs) channels per concatenated state."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: genotype, reduction, filters, input_dim, skip_dim, skip_mode, drop path settings."""
        p = super().params()
        p.define("genotype", "D", "Genotype: 'A', 'B' or 'D'.")
        p.define("reduction", False, "Whether this is a reduction cell (halves the spatial size).")
        p.define("filters", 0, "fs: channels of every operation's output.")
        p.define("input_dim", 0, "Channels of h[i-1].")
        p.define("skip_dim", 0, "Channels of h[i-2] (ignored when skip_mode is 'none').")
        p.define("skip_mode", "same", f"One of {SKIP_MODES}: h[i-2] absent (use the raw h[i-1]), on the same grid "
                 "as h[i-1], or on a grid twice as large (factorized reduction).")
        p.define("drop_path_keep_prob", 1.0, "Keep probability of drop path on every operation but id; 1.0: off.")
        p.define("drop_path_burn_in_steps", 0, "Steps over which drop path ramps in (see drop_path.py); 0: none.")
        return p

    @classmethod
    def output_dim(cls, p: InstantiableParams) -> int:
        """Channels of the cell's output: concatenated states times fs."""
        return len(cell_genotype(p.genotype, p.reduction).concat) * p.filters

    @classmethod
    def _state_dims(cls, p: InstantiableParams) -> list[int]:
        return [p.filters, p.input_dim if p.skip_mode == "none" else p.filters] + [p.filters] * 5

    @classmethod
    def children_params(cls, p: InstantiableParams) -> dict[str, InstantiableParams]:
        """Every child's Params by name, in build order (also what num_params adds up)."""
        if p.skip_mode not in SKIP_MODES:
            raise ParamsError(f"Cell.skip_mode={p.skip_mode!r} is not one of {SKIP_MODES}")
        if p.filters <= 0 or p.input_dim <= 0 or (p.skip_mode != "none" and p.skip_dim <= 0):
            raise ParamsError(f"Cell: filters, input_dim and skip_dim must be > 0, got {p.filters}, {p.input_dim}, "
                              f"{p.skip_dim}")
        fs, genotype = p.filters, cell_genotype(p.genotype, p.reduction)
        children = {"prev": ReluConvBN.params().set(input_dim=p.input_dim, output_dim=fs)}
        if p.skip_mode == "reduce":
            children["skip"] = FactorizedReduction.params().set(input_dim=p.skip_dim, output_dim=fs, relu=True)
        elif p.skip_mode == "same" and p.skip_dim != fs:
            children["skip"] = ReluConvBN.params().set(input_dim=p.skip_dim, output_dim=fs)
        dims = cls._state_dims(p)
        for j, block in enumerate(genotype.blocks, start=2):
            for side, op, src in (("left", block.op_left, block.input_left),
                                  ("right", block.op_right, block.input_right)):
                stride = 2 if p.reduction and src < 2 else 1
                children[f"block{j}_{side}"] = op_params(op, dims[src], fs, stride)
                if op != "id" and p.drop_path_keep_prob < 1.0:
                    children[f"block{j}_{side}_drop"] = DropPath.params().set(
                        keep_prob=p.drop_path_keep_prob, burn_in_steps=p.drop_path_burn_in_steps)
        for src in genotype.concat:
            if src < 2 and (p.reduction or dims[src] != fs):
                children[f"concat{src}"] = FactorizedReduction.params().set(
                    input_dim=dims[src], output_dim=fs, stride=2 if p.reduction else 1)
        return children

    @classmethod
    def _wire(cls, p: InstantiableParams, inputs: tuple[Any, Any], apply: Callable[[str, Any], Any],
              add: Callable[[Any, Any], Any], concat: Callable[[list[Any]], Any]) -> tuple[Any, Any]:
        """The cell's data flow over values of any kind, given how to apply a child, add and concatenate."""
        names = cls.children_params(p)
        h_prev, h_skip = inputs
        states = [apply("prev", h_prev)]
        if p.skip_mode == "none":
            states.append(h_prev)
        else:
            states.append(apply("skip", h_skip) if "skip" in names else h_skip)
        for j, block in enumerate(cell_genotype(p.genotype, p.reduction).blocks, start=2):
            outs = []
            for side, src in (("left", block.input_left), ("right", block.input_right)):
                name = f"block{j}_{side}"
                out = apply(name, states[src])
                outs.append(apply(f"{name}_drop", out) if f"{name}_drop" in names else out)
            states.append(add(*outs))
        picked = [apply(f"concat{src}", states[src]) if f"concat{src}" in names else states[src]
                  for src in cell_genotype(p.genotype, p.reduction).concat]
        return concat(picked), h_prev

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, child in self.children_params(self.p).items():
            self.create_child(name, child)

    def fprop(self, theta: Mapping[str, Any], inputs: tuple[tf.Tensor, tf.Tensor],
              ctx: FPropContext) -> tuple[tf.Tensor, tf.Tensor]:
        """(h[i-1], h[i-2]) -> (h[i], h[i-1])."""
        def apply(name: str, x: tf.Tensor) -> tf.Tensor:
            return self.children[name].fprop(theta[name], x, ctx)

        return self._wire(self.p, tuple(inputs), apply, tf.add, lambda xs: tf.concat(xs, axis=-1))

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Sum of the children's counts."""
        return sum(cp.cls.num_params(cp) for cp in cls.children_params(p).values())

    @classmethod
    def _trace_specs(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec],
                     flops: list[float] | None, kept: list[int] | None = None
                     ) -> tuple[tf.TensorSpec, tf.TensorSpec]:
        """Runs `_wire` on TensorSpecs, appending each step's flops to `flops` and its activation bytes to `kept`
        unless they are None."""
        children = cls.children_params(p)
        if p.skip_mode != "none" and "skip" not in children and input_spec[1].shape[-1] != p.filters:
            raise ParamsError(f"Cell expects h[i-2] with {p.filters} channels, got shape {input_spec[1].shape}")

        def apply(name: str, spec: tf.TensorSpec) -> tf.TensorSpec:
            cp = children[name]
            if flops is not None:
                flops.append(cp.cls.flops(cp, spec))
            if kept is not None:
                kept.append(cp.cls.activation_bytes(cp, spec))
            return cp.cls.output_spec(cp, spec)

        def add(a: tf.TensorSpec, b: tf.TensorSpec) -> tf.TensorSpec:
            if a.shape != b.shape:
                raise ParamsError(f"Cell (genotype {p.genotype}, reduction={p.reduction}): a block adds shapes "
                                  f"{a.shape} and {b.shape}; are h[i-1] and h[i-2] on the grids skip_mode="
                                  f"{p.skip_mode!r} says?")
            if flops is not None:
                flops.append(float(num_elements(a)))
            if kept is not None:
                kept.append(elements_bytes(a))
            return a

        def concat(specs: list[tf.TensorSpec]) -> tf.TensorSpec:
            if any(s.shape[:-1] != specs[0].shape[:-1] for s in specs):
                raise ParamsError(f"Cell (genotype {p.genotype}): concatenated states have different grids: "
                                  f"{[s.shape for s in specs]}")
            channels = sum(int(s.shape[-1]) for s in specs)
            out = tf.TensorSpec(specs[0].shape[:-1].concatenate([channels]), specs[0].dtype)
            if kept is not None:
                kept.append(elements_bytes(out))
            return out

        return cls._wire(p, tuple(input_spec), apply, add, concat)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec]
                    ) -> tuple[tf.TensorSpec, tf.TensorSpec]:
        """(spec of h[i], spec of h[i-1])."""
        return cls._trace_specs(p, input_spec, None)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec]) -> float:
        """Sum over the operations, block additions and input adjustments."""
        flops: list[float] = []
        cls._trace_specs(p, input_spec, flops)
        return float(sum(flops))

    @classmethod
    def output_read_directly(cls, p: InstantiableParams) -> bool:
        """Whether a later cell's gradient may read this cell's output itself (so the output is kept).

        The output's readers, from the network's wiring: the next cell's input 1x1 (a ReLU first), the head (a
        ReLU first) and the cell after next as h[i-2]. That one adjusts h[i-2] with a ReLU first unless it already
        has that cell's fs channels on its grid; a later cell's fs is this cell's or twice it, so the output can
        arrive unchanged only when it concatenates one or two states, and is then read directly only where an
        operation on state 1 reads its input (max pooling)."""
        concat = len(cell_genotype(p.genotype, p.reduction).concat)
        if concat * p.filters not in (p.filters, 2 * p.filters):
            return False
        dim = concat * p.filters
        for reduction in (False, True):
            for block in cell_genotype(p.genotype, reduction).blocks:
                for op, src in ((block.op_left, block.input_left), (block.op_right, block.input_right)):
                    cp = op_params(op, dim, dim, 2 if reduction else 1)
                    if src == 1 and getattr(cp.cls, "reads_input", lambda _: False)(cp):
                        return True
        return False

    @classmethod
    def shared_with_previous_bytes(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec]
                                   ) -> int:
        """Bytes of `activation_bytes` that the previous layer, when it runs in the same graph, already keeps: the
        ReLU of h[i-2], where the cell starts an operation with one. The previous cell passed h[i-2] on as its
        h[i-1] and started its input 1x1 with a ReLU of it (the stem's pair is one tensor and an identity of it),
        and graph rewrites compute a ReLU of one tensor once."""
        walk = cls._walk(p, input_spec)
        skip = walk["inputs"][1]
        return elements_bytes(walk["specs"][skip]) if skip in walk["relu_read"] else 0

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec]) -> int:
        """What the cell keeps for its backward pass, from its wiring: every operation's internal tensors; one ReLU
        output per state that operations start with a ReLU of (graph rewrites compute it once); every state
        made in the cell that an operation's gradient reads directly (max pooling, a conv with no ReLU first);
        and the concatenated output only where a later cell may read it directly (`output_read_directly`; its
        other readers start with a ReLU, which keeps its own output). Operation outputs feed additions and the
        concatenation, whose gradients read nothing, so they are not kept."""
        walk = cls._walk(p, input_spec)
        specs, inputs, relu_read = walk["specs"], walk["inputs"], walk["relu_read"]
        made_here = [t for t in walk["direct_read"] if t not in inputs]
        return (walk["internal"] + sum(elements_bytes(specs[t]) for t in relu_read)
                + sum(elements_bytes(specs[t]) for t in made_here)
                + (elements_bytes(specs[walk["out"]]) if cls.output_read_directly(p) else 0))

    @classmethod
    def _walk(cls, p: InstantiableParams, input_spec: tuple[tf.TensorSpec, tf.TensorSpec]) -> dict[str, Any]:
        """Runs `_wire` on tokens of specs: the specs, the input and output tokens, the states ReLU'd or read
        directly by an operation, and the operations' internal bytes."""
        children = cls.children_params(p)
        specs: list[tf.TensorSpec] = []
        relu_read: set[int] = set()
        direct_read: set[int] = set()
        internal = [0]

        def token(spec: tf.TensorSpec) -> int:
            specs.append(spec)
            return len(specs) - 1

        def apply(name: str, t: int) -> int:
            cp = children[name]
            op = cp.cls
            if hasattr(op, "internal_activation_bytes"):
                internal[0] += op.internal_activation_bytes(cp, specs[t])
                (relu_read if op.leading_relu(cp) else set()).add(t)
                (direct_read if op.reads_input(cp) else set()).add(t)
            else:  # DropPath: a per-example mask; the divide by a constant keeps nothing of its input
                internal[0] += op.activation_bytes(cp, specs[t]) - (elements_bytes(specs[t])
                                                                   if op.activation_bytes(cp, specs[t]) else 0)
            return token(op.output_spec(cp, specs[t]))

        def concat(tokens: list[int]) -> int:
            channels = sum(int(specs[t].shape[-1]) for t in tokens)
            return token(tf.TensorSpec(specs[tokens[0]].shape[:-1].concatenate([channels]), specs[tokens[0]].dtype))

        inputs = (token(input_spec[0]), token(input_spec[1]))
        out, _ = cls._wire(p, inputs, apply, lambda a, b: token(specs[a]), concat)
        return {"specs": specs, "inputs": inputs, "out": out, "relu_read": relu_read, "direct_read": direct_read,
                "internal": internal[0]}
