"""The operations of AmoebaNet cells (paper_facts §2), as layers, and `op_params` to build one by name.

fs below is the filter count of the cell; no convolution has a bias (batch norm follows each one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.amoebanet.conv import Conv2D, ConvScratch, DepthwiseConv2D, as_pair, check_channels, output_hw
from gpipe_tf.layers.base_layer import BaseLayer, FPropContext, elements_bytes, num_elements
from gpipe_tf.layers.batch_norm import BatchNorm

OP_NAMES = ("sep3", "sep5", "sep7", "dil2sep5", "c1x7_7x1", "c3x3", "c1x1", "id", "avg3", "max3", "max2")


class ReluConvBN(ConvScratch, BaseLayer):
    """[ReLU ->] conv (kernel, stride) -> batch norm: c1x1, a projecting id, and the cells' input 1x1s."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, output_dim, kernel_size, stride, relu."""
        p = super().params()
        p.define("input_dim", 0, "Input channels.")
        p.define("output_dim", 0, "Output channels.")
        p.define("kernel_size", 1, "Kernel size: an int or (height, width).")
        p.define("stride", 1, "Stride: an int or (height, width).")
        p.define("relu", True, "Whether a ReLU comes first.")
        return p

    @classmethod
    def _conv(cls, p: InstantiableParams) -> InstantiableParams:
        return Conv2D.params().set(input_dim=p.input_dim, output_dim=p.output_dim, kernel_size=p.kernel_size,
                                   stride=p.stride)

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self.create_child("conv", self._conv(self.p))
        self.create_child("bn", BatchNorm.params().set(dim=self.p.output_dim))

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """[ReLU ->] conv -> BN."""
        x = tf.nn.relu(inputs) if self.p.relu else inputs
        x = self.children["conv"].fprop(theta["conv"], x, ctx)
        return self.children["bn"].fprop(theta["bn"], x, ctx)

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The conv's weights plus gamma and beta."""
        return Conv2D.num_params(cls._conv(p)) + 2 * p.output_dim

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """The conv's output spec."""
        return Conv2D.output_spec(cls._conv(p), input_spec)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """ReLU, conv and batch norm."""
        out = cls.output_spec(p, input_spec)
        relu = num_elements(input_spec) if p.relu else 0
        bn = BatchNorm.params().set(dim=p.output_dim)
        return relu + Conv2D.flops(cls._conv(p), input_spec) + BatchNorm.flops(bn, out)

    @classmethod
    def leading_relu(cls, p: InstantiableParams) -> bool:
        """Whether the op starts with a ReLU of its input (kept once per input: graph rewrites share it)."""
        return bool(p.relu)

    @classmethod
    def reads_input(cls, p: InstantiableParams) -> bool:
        """Whether the op's gradient reads its input itself (a conv with no ReLU first)."""
        return not p.relu

    @classmethod
    def internal_activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """Kept inside, besides a leading ReLU and the output: the conv's output (the batch norm reads it)."""
        return Conv2D.activation_bytes(cls._conv(p), input_spec)

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The ReLU's output (its gradient reads it), the conv's (the batch norm reads it) and the batch norm's."""
        return op_activation_bytes(cls, p, input_spec)


def _chain_spec(parts: list[tuple[type, InstantiableParams]], input_spec: tf.TensorSpec) -> tf.TensorSpec:
    """Output spec of sub-layers applied in sequence."""
    for cls, p in parts:
        input_spec = cls.output_spec(p, input_spec)
    return input_spec


def op_activation_bytes(op: type, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
    """A cell operation's activation bytes as a layer on its own: its leading ReLU's output, its internal tensors
    and its output (a cell counts the ReLU once per input and the output only where a reader keeps it)."""
    relu = elements_bytes(input_spec) if op.leading_relu(p) else 0
    return relu + op.internal_activation_bytes(p, input_spec) + elements_bytes(op.output_spec(p, input_spec))


def _chain_flops(parts: list[tuple[type, InstantiableParams]], input_spec: tf.TensorSpec) -> float:
    """Total flops of sub-layers applied in sequence."""
    total = 0.0
    for cls, p in parts:
        total += cls.flops(p, input_spec)
        input_spec = cls.output_spec(p, input_spec)
    return total


class SepConv(ConvScratch, BaseLayer):
    """sepK: two repeats of [ReLU -> depthwise KxK -> pointwise 1x1 to output_dim -> BN]; stride in the first."""

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, output_dim, kernel_size, stride."""
        p = super().params()
        p.define("input_dim", 0, "Input channels.")
        p.define("output_dim", 0, "Output channels (fs).")
        p.define("kernel_size", 3, "K of the depthwise KxK convolutions.")
        p.define("stride", 1, "Stride of the first depthwise convolution.")
        return p

    @classmethod
    def _parts(cls, p: InstantiableParams) -> list[tuple[str, type, InstantiableParams]]:
        parts = []
        for r, (dim, stride) in enumerate([(p.input_dim, p.stride), (p.output_dim, 1)]):
            parts += [(f"depthwise_{r}", DepthwiseConv2D,
                       DepthwiseConv2D.params().set(dim=dim, kernel_size=p.kernel_size, stride=stride)),
                      (f"pointwise_{r}", Conv2D, Conv2D.params().set(input_dim=dim, output_dim=p.output_dim)),
                      (f"bn_{r}", BatchNorm, BatchNorm.params().set(dim=p.output_dim))]
        return parts

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        for name, _, cp in self._parts(self.p):
            self.create_child(name, cp)

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Applies the two repeats, a ReLU before each depthwise convolution."""
        x = inputs
        for name, child in self.children.items():
            if name.startswith("depthwise"):
                x = tf.nn.relu(x)
            x = child.fprop(theta[name], x, ctx)
        return x

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Sum over the two repeats."""
        return sum(c.num_params(cp) for _, c, cp in cls._parts(p))

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """The last batch norm's output."""
        return _chain_spec([(c, cp) for _, c, cp in cls._parts(p)], input_spec)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """Convolutions, batch norms and the two ReLUs."""
        total, spec = 0.0, input_spec
        for name, c, cp in cls._parts(p):
            if name.startswith("depthwise"):
                total += num_elements(spec)
            total += c.flops(cp, spec)
            spec = c.output_spec(cp, spec)
        return total

    @classmethod
    def leading_relu(cls, p: InstantiableParams) -> bool:
        """Starts with a ReLU of its input."""
        return True

    @classmethod
    def reads_input(cls, p: InstantiableParams) -> bool:
        """No: the ReLU's output is what the depthwise conv reads."""
        return False

    @classmethod
    def internal_activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """Per repeat: the depthwise output (the pointwise conv reads it), the pointwise output (the batch norm reads
        it); between the repeats the second ReLU's output (the first batch norm's output feeds only that ReLU,
        whose gradient reads its own output). The last batch norm's output is the op's output."""
        total, spec = 0, input_spec
        for name, c, cp in cls._parts(p):
            if name == "depthwise_1":
                total += elements_bytes(spec)
            out = c.output_spec(cp, spec)
            if not name.startswith("bn"):
                total += elements_bytes(out)
            spec = out
        return total

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The leading ReLU's output, the internal tensors (`internal_activation_bytes`) and the output."""
        return op_activation_bytes(cls, p, input_spec)


class Bottleneck(ConvScratch, BaseLayer):
    """c1x7_7x1 and c3x3: ReLU-conv-BN units 1x1 to fs/4, then each kernel in `kernels`, then 1x1 to fs.

    Each middle kernel strides along the axes where it is longer than 1: 1x7 has stride (1, s), 7x1 has (s, 1) and
    3x3 has (s, s), as in paper_facts §2.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, output_dim, kernels, stride."""
        p = super().params()
        p.define("input_dim", 0, "Input channels.")
        p.define("output_dim", 0, "Output channels (fs); the bottleneck has output_dim // 4.")
        p.define("kernels", [[1, 7], [7, 1]], "Middle kernels, each (height, width).")
        p.define("stride", 1, "Reduction stride s, shared out over the middle kernels.")
        return p

    @classmethod
    def _parts(cls, p: InstantiableParams) -> list[InstantiableParams]:
        mid = p.output_dim // 4
        if mid < 1:
            raise ParamsError(f"Bottleneck.output_dim={p.output_dim} must be >= 4 (the bottleneck has fs // 4)")
        parts = [ReluConvBN.params().set(input_dim=p.input_dim, output_dim=mid)]
        for kernel in p.kernels:
            kh, kw = as_pair(kernel, "Bottleneck.kernels entry")
            stride = (p.stride if kh > 1 else 1, p.stride if kw > 1 else 1)
            parts.append(ReluConvBN.params().set(input_dim=mid, output_dim=mid, kernel_size=(kh, kw), stride=stride))
        parts.append(ReluConvBN.params().set(input_dim=mid, output_dim=p.output_dim))
        return parts

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        self.create_children("unit", self._parts(self.p))

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Applies the units in order."""
        x = inputs
        for name, child in self.children.items():
            x = child.fprop(theta[name], x, ctx)
        return x

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Sum over the units."""
        return sum(ReluConvBN.num_params(cp) for cp in cls._parts(p))

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """The last unit's output."""
        return _chain_spec([(ReluConvBN, cp) for cp in cls._parts(p)], input_spec)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """Sum over the units."""
        return _chain_flops([(ReluConvBN, cp) for cp in cls._parts(p)], input_spec)

    @classmethod
    def leading_relu(cls, p: InstantiableParams) -> bool:
        """Starts with a ReLU of its input."""
        return True

    @classmethod
    def reads_input(cls, p: InstantiableParams) -> bool:
        """No: the first unit's ReLU output is what its conv reads."""
        return False

    @classmethod
    def internal_activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """Each unit's conv output (its batch norm reads it) and, after the first, its ReLU's output."""
        total, spec = 0, input_spec
        for j, cp in enumerate(cls._parts(p)):
            if j:
                total += elements_bytes(spec)
            total += ReluConvBN.internal_activation_bytes(cp, spec)
            spec = ReluConvBN.output_spec(cp, spec)
        return total

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The leading ReLU's output, the internal tensors (`internal_activation_bytes`) and the output."""
        return op_activation_bytes(cls, p, input_spec)


class Pool(ConvScratch, BaseLayer):
    """avg3, max3, max2: SAME pooling (averages exclude the padding), then 1x1 conv + BN if channels change."""

    KINDS = ("avg", "max")

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: input_dim, output_dim, kind, window, stride."""
        p = super().params()
        p.define("input_dim", 0, "Input channels.")
        p.define("output_dim", 0, "Output channels (fs).")
        p.define("kind", "avg", f"One of {cls.KINDS}.")
        p.define("window", 3, "Square window size.")
        p.define("stride", 1, "Stride.")
        return p

    @classmethod
    def _projection(cls, p: InstantiableParams) -> InstantiableParams | None:
        if p.input_dim == p.output_dim:
            return None
        return ReluConvBN.params().set(input_dim=p.input_dim, output_dim=p.output_dim, relu=False)

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        if self.p.kind not in self.KINDS:
            raise ParamsError(f"{self.path}.kind={self.p.kind!r} is not one of {self.KINDS}")
        projection = self._projection(self.p)
        if projection is not None:
            self.create_child("projection", projection)

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Pools, then projects to output_dim channels if needed."""
        p = self.p
        # TensorFlow's SAME average pooling divides by the number of in-bounds elements: padding is excluded.
        pool = tf.nn.avg_pool2d if p.kind == "avg" else tf.nn.max_pool2d
        x = pool(inputs, p.window, p.stride, "SAME")
        if "projection" in self.children:
            x = self.children["projection"].fprop(theta["projection"], x, ctx)
        return x

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """Only the projection's, if any."""
        projection = cls._projection(p)
        return 0 if projection is None else ReluConvBN.num_params(projection)

    @classmethod
    def _pooled_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        check_channels(cls.__name__, input_spec, p.input_dim)
        h, w = output_hw(input_spec, (p.window, p.window), (p.stride, p.stride), "SAME")
        return tf.TensorSpec([input_spec.shape[0], h, w, p.input_dim], input_spec.dtype)

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Pooled shape with output_dim channels."""
        pooled = cls._pooled_spec(p, input_spec)
        projection = cls._projection(p)
        return pooled if projection is None else ReluConvBN.output_spec(projection, pooled)

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """One op per window element and output, plus the projection."""
        pooled = cls._pooled_spec(p, input_spec)
        projection = cls._projection(p)
        extra = 0.0 if projection is None else ReluConvBN.flops(projection, pooled)
        return float(num_elements(pooled) * p.window * p.window) + extra

    @classmethod
    def leading_relu(cls, p: InstantiableParams) -> bool:
        """No ReLU."""
        return False

    @classmethod
    def reads_input(cls, p: InstantiableParams) -> bool:
        """Max pooling's gradient reads its input (and output); average pooling's only shapes."""
        return p.kind == "max"

    @classmethod
    def internal_activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """Max pooling keeps its output; a projection (conv then batch norm) keeps the pooled input of its conv and
        the conv's output."""
        pooled = cls._pooled_spec(p, input_spec)
        projection = cls._projection(p)
        if projection is None:
            return elements_bytes(pooled) if p.kind == "max" else 0
        return elements_bytes(pooled) + ReluConvBN.internal_activation_bytes(projection, pooled)

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """The internal tensors (`internal_activation_bytes`) and the output."""
        return op_activation_bytes(cls, p, input_spec)


class Identity(BaseLayer):
    """id with stride 1 and matching channels: returns its input."""

    def fprop(self, theta: Mapping[str, Any], inputs: tf.Tensor, ctx: FPropContext) -> tf.Tensor:
        """Returns `inputs`."""
        return inputs

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """No weights."""
        return 0

    @classmethod
    def output_spec(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> tf.TensorSpec:
        """Unchanged."""
        return input_spec

    @classmethod
    def flops(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> float:
        """None."""
        return 0.0

    @classmethod
    def leading_relu(cls, p: InstantiableParams) -> bool:
        """No ReLU."""
        return False

    @classmethod
    def reads_input(cls, p: InstantiableParams) -> bool:
        """No."""
        return False

    @classmethod
    def internal_activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """Nothing."""
        return 0

    @classmethod
    def activation_bytes(cls, p: InstantiableParams, input_spec: tf.TensorSpec) -> int:
        """Nothing: the input passes through."""
        return 0


def op_params(name: str, input_dim: int, filters: int, stride: int) -> InstantiableParams:
    """Params of the cell operation `name` (one of OP_NAMES) from input_dim to `filters` channels.

    dil2sep5 is built as a plain sep5: the [TPU] parser drops the dilation (paper_facts §2; the paper's
    "dilated" reading is unconfirmed, and the parameter count is the same either way).
    The strided or channel-changing id is ReLU -> 1x1 (stride s) -> BN, as in [TPU].
    """
    if name in ("sep3", "sep5", "sep7", "dil2sep5"):
        return SepConv.params().set(input_dim=input_dim, output_dim=filters, kernel_size=int(name[-1]), stride=stride)
    if name == "c1x7_7x1":
        return Bottleneck.params().set(input_dim=input_dim, output_dim=filters, kernels=[[1, 7], [7, 1]],
                                       stride=stride)
    if name == "c3x3":
        return Bottleneck.params().set(input_dim=input_dim, output_dim=filters, kernels=[[3, 3]], stride=stride)
    if name == "c1x1":
        return ReluConvBN.params().set(input_dim=input_dim, output_dim=filters, stride=stride)
    if name == "id":
        if stride == 1 and input_dim == filters:
            return Identity.params()
        return ReluConvBN.params().set(input_dim=input_dim, output_dim=filters, stride=stride)
    if name in ("avg3", "max3", "max2"):
        return Pool.params().set(input_dim=input_dim, output_dim=filters, kind=name[:3], window=int(name[-1]),
                                 stride=stride)
    raise ParamsError(f"unknown AmoebaNet operation {name!r}; expected one of {OP_NAMES}")
