"""The GPipe paper's Transformer sizes (parameter counts from Params alone with `--mode=inspect`), trainable.

Two families (see the shared paper facts, sections 6 and 7):

* The multilingual ladder T(L, H, A): L encoder and L decoder layers, feed-forward size H, A attention heads of
  width 64 (64 * A attention channels), model dimension 1024, a 64k vocabulary, one input embedding shared by
  source and target and an untied output softmax (two 64k x 1024 matrices). These are TranslationTasks.
  `head_dim` is not a TranslationTask field, so it is set on every encoder and decoder layer of the spelled-out
  `task.network` (with A=32 and d=1024, model_dim // num_heads would give 32, not 64).
* Transformer-L (GPipe Table 1): d_model 2048, FFN 8192, 32 heads, 32k vocabulary, L = 3 / 13 / 103 layers of
  self-attention + feed-forward, no cross-attention, an input embedding and an untied output softmax. A
  TranslationTask always has a decoder with cross-attention, so these are ClassifierTasks over a GPipe of
  [token embedding with sinusoidal positions, L causal TransformerEncoderLayers, final LayerNorm] with a 32k
  softmax applied to every position: a language model, trained on next-token batches whose cross-entropy
  ignores padding (ClassifierTask's `weights`).

Inputs. Transformer-L reads TFDS text, lm1b by default (TfdsLanguageModelInputs: knobs dataset, text_feature,
data_dir, vocab_dir, dev_split, test_split, eval_batches), with a 32k SentencePiece vocabulary learned once from
its first million train sentences into vocab_dir; sentences are bucketed by length up to max_length = 1024.
Prepare the data where there is internet (`tfds build lm1b --data_dir=DIR`), copy DIR here, then e.g.
`python trainer.py --model=mt.gpipe_paper.TransformerL_3 --logdir=/tmp/tl3 --gin_param="TransformerL_3.data_dir='DIR'"`.
TransformerLTinyOffline is the same model at toy size (3 layers, d=64, K=2, M=4 on 4 logical CPUs) on the
offline numbers corpus as a language model; it trains on this machine's CPU in about half a minute. The ladder
keeps NumbersTiny's inputs (the spelled-out numbers translation corpus), which match its TranslationTask but are
stand-ins at these sizes: TedMultiBig (params/mt/ted_multi.py) trains T(6, 8192, 16) on TED talks. Training at
the paper's sizes needs the paper's accelerators; inspecting them builds no variables.

With the shared embedding the ladder inspects at 408.2M, 1.239B, 1.239B, 3.086B and 6.041B, within 5% of the
paper's 400M / 1.3B / 1.3B / 3B / 6B. A separate target table (share_embeddings = False) would add 65.5M to each
and put T(6, 8192, 16) 18% and T(32, 16384, 32) 5.05% above the paper. Transformer-L inspects at 282.2M, 785.8M
and 5.318B (paper: 282.2M / 785.8M / 5.3B).
"""

from __future__ import annotations

from gpipe_tf import model_registry
from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.params.mt.number_words import NumbersTiny, default_vocab_dir

# Width of every attention head in the multilingual ladder (facts, section 7).
LADDER_HEAD_DIM = 64


class _MultilingualLadder(NumbersTiny):
    """T(L, H, A) at model dimension 1024 with 64-wide heads; subclasses set L, H, A and the pipeline's K and M.

    Inherits NumbersTiny's inputs (stand-ins at these sizes, see the module doc) and training settings.
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
    schedule = "fill_drain"  # a name from gpipe_tf.gpipe.schedules.SCHEDULES, or a schedule's Params
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


class _SplitInputs:
    """train/dev/test input Params from one `_split_input(split, num_batches)` (a mixin, listed first).

    Training repeats `train_split` forever; dev and test are the first `eval_batches` batches of their splits.
    """

    train_split = "train"
    dev_split = "dev"
    test_split = "test"
    eval_batches = 10

    def _split_input(self, split: str, num_batches: int | None) -> InstantiableParams:
        raise NotImplementedError(f"{type(self).__name__}._split_input")

    def train_input(self) -> InstantiableParams:
        """`train_split`: shuffled, repeated forever."""
        return self._split_input(self.train_split, None)

    def dev_input(self) -> InstantiableParams:
        """The first `eval_batches` batches of `dev_split`, in order."""
        return self._split_input(self.dev_split, self.eval_batches)

    def test_input(self) -> InstantiableParams:
        """The first `eval_batches` batches of `test_split`, in order."""
        return self._split_input(self.test_split, self.eval_batches)


class TfdsLanguageModelInputs(_SplitInputs):
    """TFDS text inputs (lm1b by default) for a language-model experiment (a mixin, listed first).

    Sizes shared with the model (vocab_size, max_length, batch_size, vocab_dir) are the experiment's own knobs.
    lm1b has only 'train' and 'test' splits: dev and test are the two halves of its held-out 'test' split.
    Sentences are bucketed by length (8, 16, ... up to max_length); longer ones are dropped.
    """

    dataset = "lm1b"  # any TFDS dataset with a Text feature
    text_feature = "text"
    data_dir = None  # TFDS data_dir holding the prepared dataset; None: TFDS's default
    dev_split = "test[:50%]"
    test_split = "test[50%:]"
    vocab_max_sentences = 1_000_000

    def _split_input(self, split: str, num_batches: int | None) -> InstantiableParams:
        from gpipe_tf.inputs.tfds_language_model import TfdsLanguageModelInput

        return TfdsLanguageModelInput.params().set(
            dataset=self.dataset, text_feature=self.text_feature, split=split, data_dir=self.data_dir,
            vocab_size=self.vocab_size, max_length=self.max_length, vocab_dir=self.vocab_dir or default_vocab_dir(),
            vocab_max_sentences=self.vocab_max_sentences, batch_size=self.batch_size, num_batches=num_batches)


class _TransformerL(TfdsLanguageModelInputs, NumbersTiny):
    """GPipe Table 1 Transformer-L: L self-attention layers (d 2048, FFN 8192, 32 heads), 32k embedding and softmax.

    A ClassifierTask whose network is a GPipe over [TokenEmbeddingWithPositions, L causal TransformerEncoderLayers,
    LayerNorm] and whose softmax (2048 -> 32000, with bias) scores every position: a language model of the
    TfdsLanguageModelInputs text (lm1b), its cross-entropy weighted to ignore padding. Parameters per layer:
    attention 4d^2 + 4d, feed-forward 2dH + H + d, two layer norms 4d = 50,358,272; plus two untied
    32,000 x 2048 matrices (and 36,096 for the final norm and softmax bias). Training settings are NumbersTiny's.
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
    schedule = "fill_drain"  # a name from gpipe_tf.gpipe.schedules.SCHEDULES, or a schedule's Params
    dtype = "float32"
    logical_devices = None

    def task(self) -> InstantiableParams:
        """The ClassifierTask described in the class doc."""
        from gpipe_tf.gpipe.pipeline import GPipe, schedule_params
        from gpipe_tf.layers.normalization import LayerNorm
        from gpipe_tf.layers.positions import TokenEmbeddingWithPositions
        from gpipe_tf.layers.transformer import TransformerEncoderLayer
        from gpipe_tf.tasks.classifier import ClassifierTask

        layers = [TokenEmbeddingWithPositions.params().set(
            name="emb", vocab_size=self.vocab_size, embedding_dim=self.model_dim, dropout_rate=self.dropout_rate)]
        for i in range(self.num_layers):
            layers.append(TransformerEncoderLayer.params().set(
                name=f"layer_{i}", model_dim=self.model_dim, num_heads=self.num_heads, hidden_dim=self.hidden_dim,
                dropout_rate=self.dropout_rate, causal=True))
        layers.append(LayerNorm.params().set(name="final_norm", dim=self.model_dim))
        network = GPipe.params().set(
            name="network", layers=layers, num_stages=self.num_stages, num_micro_batches=self.num_micro_batches,
            remat=self.remat, schedule=schedule_params(self.schedule),
            # The longest micro-batch the inputs give, so that the memory planner needs no flag to size it.
            micro_batch_shape=[self.batch_size // self.num_micro_batches, self.max_length], input_dtype="int32")
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


class NumbersLanguageModelInputs(_SplitInputs):
    """Offline language-model inputs from the spelled-out numbers corpus (a mixin, listed first).

    Uses the experiment's max_number, vocab_size, max_length, vocab_dir and batch_size knobs; dev and test are
    the corpus's dev and test numbers, in corpus order.
    """

    dev_split = "dev"
    test_split = "test"

    def _split_input(self, split: str, num_batches: int | None) -> InstantiableParams:
        from gpipe_tf.inputs.language_model_input import NumbersLanguageModelInput

        return NumbersLanguageModelInput.params().set(
            split=split, max_number=self.max_number, vocab_size=self.vocab_size, max_length=self.max_length,
            vocab_dir=self.vocab_dir or default_vocab_dir(), batch_size=self.batch_size, num_batches=num_batches)


@model_registry.register
class TransformerLTinyOffline(NumbersLanguageModelInputs, _TransformerL):
    """Transformer-L's shape at toy size, offline: 3 causal layers (d=64) in a 2-stage GPipe over 4 micro-batches on
    4 logical CPU devices, a language model of the tagged spelled-out numbers ("<2fr> vingt et un")."""

    max_number = 2000
    vocab_size = 500
    max_length = 16
    model_dim = 64
    num_heads = 4
    hidden_dim = 256
    num_layers = 3
    batch_size = 32
    num_stages = 2
    num_micro_batches = 4
    remat = "never"
    dropout_rate = 0.0
    label_smoothing = 0.0
    # Measured here (2 cores): 600 steps take the train loss from 6.26 (ln 500 = 6.21) to 1.43 and reach dev loss
    # 1.73 and next-token accuracy 48% in ~30 s. The floor for a uniformly drawn number and language is about
    # (ln 2,000 + ln 10) / 7.4 labels per sentence = 1.34 nats per label.
    learning_rate = 3e-3
    warmup_steps = 20
    max_steps = 600
    logical_devices = 4
