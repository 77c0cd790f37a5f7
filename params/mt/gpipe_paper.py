"""The GPipe paper's Transformer sizes, as experiments for `--mode=inspect` (parameter counts from Params alone).

Two families (see the shared paper facts, sections 6 and 7):

* The multilingual ladder T(L, H, A): L encoder and L decoder layers, feed-forward size H, A attention heads of
  width 64 (64 * A attention channels), model dimension 1024, a 64k vocabulary, one input embedding shared by
  source and target and an untied output softmax (two 64k x 1024 matrices). These are TranslationTasks.
  `head_dim` is not a TranslationTask field, so it is set on every encoder and decoder layer of the spelled-out
  `task.network` (with A=32 and d=1024, model_dim // num_heads would give 32, not 64).
* Transformer-L (GPipe Table 1): d_model 2048, FFN 8192, 32 heads, 32k vocabulary, L = 3 / 13 / 103 layers of
  self-attention + feed-forward, no cross-attention, an input embedding and an untied output softmax. A
  TranslationTask always has a decoder with cross-attention, so these are ClassifierTasks over a GPipe of
  [token embedding with sinusoidal positions, L TransformerEncoderLayers, final LayerNorm] with a 32k softmax
  applied to every position (a language-model-shaped stack built from existing layers only).

The inputs of every experiment here are placeholders inherited from NumbersTiny (NumbersTranslationInput Params,
the spelled-out-numbers corpus; for Transformer-L they do not even match the ClassifierTask's `inputs`/`labels`
batch). They only make the Params tree complete for `--mode=inspect`; training at these sizes needs real data
(for the multilingual models the TED multilingual corpus, see params/mt/ted_multi.py) and the paper's
accelerators. Nothing here builds variables.

With the shared embedding the ladder inspects at 408.2M, 1.239B, 1.239B, 3.086B and 6.041B, within 5% of the
paper's 400M / 1.3B / 1.3B / 3B / 6B. A separate target table (share_embeddings = False) would add 65.5M to each
and put T(6, 8192, 16) 18% and T(32, 16384, 32) 5.05% above the paper.
"""

from __future__ import annotations

import model_registry
from gpipe_tf.hyperparams import InstantiableParams
from params.mt.numbers import NumbersTiny

# Width of every attention head in the multilingual ladder (facts, section 7).
LADDER_HEAD_DIM = 64


class _MultilingualLadder(NumbersTiny):
    """T(L, H, A) at model dimension 1024 with 64-wide heads; subclasses set L, H, A and the pipeline's K and M.

    Inherits NumbersTiny's inputs (placeholders, see the module doc) and training settings.
    """

    vocab_size = 64000
    max_length = 256
    model_dim = 1024
    num_heads = 16
    head_dim = LADDER_HEAD_DIM
    share_embeddings = True  # the paper's count has one input embedding for source and target (module doc)
    hidden_dim = 8192
    num_encoder_layers = 6
    num_decoder_layers = 6
    batch_size = 4096
    num_stages = 1
    num_micro_batches = 1
    remat = "always"
    schedule = "loop"
    dtype = "float32"
    logical_devices = None

    def task(self) -> InstantiableParams:
        """NumbersTiny's TranslationTask with `head_dim` set on every encoder and decoder layer of the network."""
        from gpipe_tf.layers.seq2seq_adapters import EncoderBlock
        from gpipe_tf.layers.transformer_decoder import TransformerDecoderLayer

        p = super().task()
        for lp in p.network.layers:
            if lp.cls is EncoderBlock:
                lp.layer.set(head_dim=self.head_dim)
            elif lp.cls is TransformerDecoderLayer:
                lp.set(head_dim=self.head_dim)
        return p


@model_registry.register
class T6_8192_16(_MultilingualLadder):  # noqa: N801 (the paper's name)
    """T(6, 8192, 16), "Transformer Big" (paper: 400M). No accelerator count in the paper: K=1, M=1."""

    num_encoder_layers = 6
    num_decoder_layers = 6
    hidden_dim = 8192
    num_heads = 16
    num_stages = 1
    num_micro_batches = 1
    remat = "never"


@model_registry.register
class T24_8192_16(_MultilingualLadder):  # noqa: N801
    """T(24, 8192, 16), the deep 1.3B model, on 4 accelerators: K=4, M=32."""

    num_encoder_layers = 24
    num_decoder_layers = 24
    hidden_dim = 8192
    num_heads = 16
    num_stages = 4
    num_micro_batches = 32


@model_registry.register
class T12_16384_32(_MultilingualLadder):  # noqa: N801
    """T(12, 16384, 32), the wide 1.3B model, on 2 accelerators: K=2, M=32."""

    num_encoder_layers = 12
    num_decoder_layers = 12
    hidden_dim = 16384
    num_heads = 32
    num_stages = 2
    num_micro_batches = 32


@model_registry.register
class T32_16384_32(_MultilingualLadder):  # noqa: N801
    """T(32, 16384, 32), the 3B model, on 8 accelerators: K=8, M=32."""

    num_encoder_layers = 32
    num_decoder_layers = 32
    hidden_dim = 16384
    num_heads = 32
    num_stages = 8
    num_micro_batches = 32


@model_registry.register
class T64_16384_32(_MultilingualLadder):  # noqa: N801
    """T(64, 16384, 32), the 6B model with 128 layers, on 16 accelerators: K=16, M=32."""

    num_encoder_layers = 64
    num_decoder_layers = 64
    hidden_dim = 16384
    num_heads = 32
    num_stages = 16
    num_micro_batches = 32


class _TransformerL(NumbersTiny):
    """GPipe Table 1 Transformer-L: L self-attention layers (d 2048, FFN 8192, 32 heads), 32k embedding and softmax.

    A ClassifierTask whose network is a GPipe over [TokenEmbeddingWithPositions, L TransformerEncoderLayers,
    LayerNorm] and whose softmax (2048 -> 32000, with bias) scores every position. Parameters per layer:
    attention 4d^2 + 4d, feed-forward 2dH + H + d, two layer norms 4d = 50,358,272; plus two untied
    32,000 x 2048 matrices (and 36,096 for the final norm and softmax bias).
    """

    vocab_size = 32000
    max_length = 1024
    model_dim = 2048
    num_heads = 32
    hidden_dim = 8192
    num_layers = 3
    batch_size = 32
    num_stages = 1
    num_micro_batches = 1
    remat = "never"
    schedule = "loop"
    dtype = "float32"
    logical_devices = None

    def task(self) -> InstantiableParams:
        """The ClassifierTask described in the class doc."""
        from gpipe_tf.gpipe.pipeline import GPipe
        from gpipe_tf.layers.normalization import LayerNorm
        from gpipe_tf.layers.positions import TokenEmbeddingWithPositions
        from gpipe_tf.layers.transformer import TransformerEncoderLayer
        from gpipe_tf.tasks.classifier import ClassifierTask

        layers = [TokenEmbeddingWithPositions.params().set(
            name="emb", vocab_size=self.vocab_size, embedding_dim=self.model_dim, dropout_rate=self.dropout_rate)]
        for i in range(self.num_layers):
            layers.append(TransformerEncoderLayer.params().set(
                name=f"layer_{i}", model_dim=self.model_dim, num_heads=self.num_heads, hidden_dim=self.hidden_dim,
                dropout_rate=self.dropout_rate))
        layers.append(LayerNorm.params().set(name="final_norm", dim=self.model_dim))
        network = GPipe.params().set(
            name="network", layers=layers, num_stages=self.num_stages, num_micro_batches=self.num_micro_batches,
            remat=self.remat, schedule=self.schedule)
        p = ClassifierTask.params().set(name="transformer_l", dtype=self.dtype, network=network)
        p.softmax.set(input_dim=self.model_dim, num_classes=self.vocab_size, label_smoothing=self.label_smoothing)
        return p


@model_registry.register
class TransformerL_3(_TransformerL):  # noqa: N801
    """Transformer-L with 3 layers, Table 1's Naive-1 column (paper: 282.2M): K=1, M=1, no remat."""

    num_layers = 3


@model_registry.register
class TransformerL_13(_TransformerL):  # noqa: N801
    """Transformer-L with 13 layers, Table 1's Pipeline-1 column (paper: 785.8M): K=1, M=32, remat."""

    num_layers = 13
    num_micro_batches = 32
    remat = "always"


@model_registry.register
class TransformerL_103(_TransformerL):  # noqa: N801
    """Transformer-L with 103 layers, Table 1's Pipeline-8 column (paper: 5.3B): K=8, M=32, remat."""

    num_layers = 103
    num_stages = 8
    num_micro_batches = 32
    remat = "always"
