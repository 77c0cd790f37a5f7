"""A sequence of layers applied one after another (the un-pipelined form of a GPipe layer list)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext


class Sequential(BaseLayer):
    """Applies `layers` in order; each layer's output is the next one's input."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: layers (a list of layer Params)."""
        p = super().params()
        p.define("layers", [], "Layer Params, applied in this order.")
        return p

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        if not self.p.layers:
            raise ParamsError(f"{self.path}.layers is empty; give at least one layer's Params")
        self.create_children("layer", list(self.p.layers))

    def fprop(self, theta: Mapping[str, Any], inputs: Any, ctx: FPropContext) -> Any:
        """Runs every layer in order."""
        out = inputs
        for name, layer in self.children.items():
            out = layer.fprop(theta[name], out, ctx)
        return out

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Sum of the layers' counts."""
        return sum(lp.cls.num_params(lp) for lp in p.layers)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: Any) -> Any:
        """Each layer's output spec feeds the next."""
        for lp in p.layers:
            input_spec = lp.cls.output_spec(lp, input_spec)
        return input_spec

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: Any) -> float:
        """Sum over the layers, propagating shapes."""
        total = 0.0
        for lp in p.layers:
            total += lp.cls.flops(lp, input_spec)
            input_spec = lp.cls.output_spec(lp, input_spec)
        return total

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: Any) -> int:
        """Sum over the layers, propagating shapes."""
        total = 0
        for lp in p.layers:
            total += lp.cls.activation_bytes(lp, input_spec)
            input_spec = lp.cls.output_spec(lp, input_spec)
        return total
