"""AmoebaNet (A, B, D) as GPipe-ready layers: `amoebanet_layers` returns the model as a flat layer list."""

from gpipe_tf.layers.amoebanet.cells import Cell
from gpipe_tf.layers.amoebanet.conv import Conv2D, DepthwiseConv2D
from gpipe_tf.layers.amoebanet.drop_path import DropPath, set_drop_path_step
from gpipe_tf.layers.amoebanet.genotypes import GENOTYPES, cell_genotype
from gpipe_tf.layers.amoebanet.head import ClassifierHead
from gpipe_tf.layers.amoebanet.network import amoebanet_layers
from gpipe_tf.layers.amoebanet.ops import Bottleneck, Identity, Pool, ReluConvBN, SepConv, op_params
from gpipe_tf.layers.amoebanet.reduction import FactorizedReduction
from gpipe_tf.layers.amoebanet.stem import ConvStem

__all__ = ["Bottleneck", "Cell", "ClassifierHead", "Conv2D", "ConvStem", "DepthwiseConv2D", "DropPath",
           "FactorizedReduction", "GENOTYPES", "Identity", "Pool", "ReluConvBN", "SepConv", "amoebanet_layers",
           "cell_genotype", "op_params", "set_drop_path_step"]
