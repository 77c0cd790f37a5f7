"""Models and graph probes shared by the pipeline tests: a tanh MLP, a shape-changing conv stack on pairs, op
counts of a traced graph, and the placed (partitioned) graphs a function runs."""

import re

import tensorflow as tf

from gpipe_tf.layers.base_layer import BaseLayer
from gpipe_tf.layers.dropout import Dropout
from gpipe_tf.layers.linear import Linear

BATCH = 24
DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def mlp_layers(dtype, dropout=0.0, width=6, depth=8):
    layers = []
    for _ in range(depth):
        layers.append(Linear.params().set(input_dim=width, output_dim=width, activation="tanh"))
        if dropout:
            layers.append(Dropout.params().set(rate=dropout))
    return layers


class PairConv(BaseLayer):
    """Test layer on a pair (h, skip): h -> relu(conv(h)) with a stride, skip -> pooled to h's new size + proj."""

    @classmethod
    def params(cls):
        p = super().params()
        p.define("in_ch", 2, "")
        p.define("out_ch", 2, "")
        p.define("stride", 1, "")
        return p

    def __init__(self, params, parent_path=""):
        super().__init__(params, parent_path)
        self.create_variable("w", [3, 3, self.p.in_ch, self.p.out_ch])
        self.create_variable("s", [1, 1, self.p.in_ch, self.p.out_ch])

    def fprop(self, theta, inputs, ctx):
        h, skip = inputs
        st = self.p.stride
        new_h = tf.nn.relu(tf.nn.conv2d(h, theta["w"], st, "SAME"))
        new_skip = tf.nn.conv2d(tf.nn.avg_pool2d(skip, st, st, "SAME"), theta["s"], 1, "SAME") + new_h
        return new_h, new_skip

    @classmethod
    def num_params(cls, p):
        return 10 * p.in_ch * p.out_ch


def conv_layers(dtype):
    chans = [2, 3, 3, 4, 4, 5]
    strides = [1, 2, 1, 2, 1]
    return [PairConv.params().set(in_ch=a, out_ch=b, stride=s) for a, b, s in zip(chans[:-1], chans[1:], strides)]


def count_ops(graph):
    """Operations of a graph and of every function it calls (a size that must not grow with M)."""
    total = len(graph.get_operations())
    for fn in graph._functions.values():
        total += len(fn.graph.get_operations()) if hasattr(fn, "graph") else 0
    return total


def placed_ops(fn, *args, pipeline=None):
    """(device suffix, op type, name, NodeDef) of every node of the placed (partitioned) graphs that running fn builds.

    With `pipeline` (a GPipe layer), only the function graphs that run its stages: in a long test session the
    collected graphs can also hold other functions' (seen after the float64 tests of this file).
    """
    from tensorflow.python.eager import context

    context.enable_run_metadata()
    context.enable_graph_collection()
    try:
        fn(*args)
        metadata = context.export_run_metadata()
    finally:
        context.disable_graph_collection()
        context.disable_run_metadata()
    graphs = list(metadata.function_graphs)
    if pipeline is not None:
        tokens = re.compile("|".join(rf"(?<!\d){re.escape(t)}(?!\d)" for t in pipeline.stage_scopes))
        graphs = [g for g in graphs if any(tokens.search(n.name) for part in g.partition_graphs for n in part.node)]
        assert graphs, "no collected graph runs the pipeline's stages"
    return [(node.device.split("device:")[-1], node.op, node.name, node)
            for graph in graphs for part in graph.partition_graphs for node in part.node]
