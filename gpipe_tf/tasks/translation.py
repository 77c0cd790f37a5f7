"""Pipelined encoder-decoder Transformer translation: GPipe over one flat layer list, softmax, beam search.

The network is a GPipe over [SourceEmbedding, EncoderBlock x N, EncoderToDecoder, TransformerDecoderLayer x M,
FinalNorm] (see layers/seq2seq_adapters.py), so source and target tensors of a micro-batch travel together from
stage to stage. With `share_embeddings` (the default, as in the GPipe paper and Lingvo), the first stage embeds
source and target ids with one table and the embedded target travels through the encoder stages; otherwise
EncoderToDecoder embeds the target with a second table. The output softmax is never tied to the embedding.

Decoding does not use the pipeline: it runs the same child layers in order, un-pipelined, once for the encoder,
then one decoder step at a time with cached keys and values, embedding each new target token with the table that
training used for the target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from gpipe_tf.decoding.search import beam_search, greedy_search
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.layers.base_layer import FPropContext
from gpipe_tf.layers.seq2seq_adapters import EncoderBlock, EncoderToDecoder, FinalNorm, SourceEmbedding
from gpipe_tf.layers.softmax import SoftmaxCrossEntropy
from gpipe_tf.layers.transformer import TransformerEncoderLayer
from gpipe_tf.layers.transformer_decoder import TransformerDecoderLayer
from gpipe_tf.tasks.base_task import BaseTask, Metrics


def translation_layers(p: InstantiableParams) -> list[InstantiableParams]:
    """The flat pipeline layer list of a TranslationTask's Params (order: module doc)."""
    common = dict(model_dim=p.model_dim, num_heads=p.num_heads, hidden_dim=p.hidden_dim,
                  dropout_rate=p.dropout_rate)
    embedding = dict(vocab_size=p.vocab_size, model_dim=p.model_dim, dropout_rate=p.dropout_rate)
    layers = [SourceEmbedding.params().set(name="src_emb", embed_target=p.share_embeddings, **embedding)]
    for i in range(p.num_encoder_layers):
        layers.append(EncoderBlock.params().set(name=f"encoder_{i}",
                                                layer=TransformerEncoderLayer.params().set(**common)))
    layers.append(EncoderToDecoder.params().set(name="enc_to_dec", embed_target=not p.share_embeddings,
                                                **embedding))
    for i in range(p.num_decoder_layers):
        layers.append(TransformerDecoderLayer.params().set(name=f"decoder_{i}", **common))
    layers.append(FinalNorm.params().set(name="final_norm", model_dim=p.model_dim))
    return layers


class TranslationTask(BaseTask):
    """Sequence-to-sequence Transformer trained with label-smoothed cross-entropy, run as a GPipe pipeline.

    Batches are NumbersTranslationInput's: src_ids, src_paddings, tgt_in_ids, tgt_out_ids, tgt_paddings.
    """

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: model sizes, dropout, label smoothing and the pipeline's K, M, remat and schedule."""
        p = super().params()
        p.define("vocab_size", 0, "Shared source/target vocabulary size.")
        p.define("share_embeddings", True, "One embedding table for source and target ids, in the first pipeline "
                 "stage (the GPipe paper's and Lingvo's setting: an input embedding plus an untied softmax). False: "
                 "EncoderToDecoder embeds the target with a table of its own (three vocabulary-sized matrices).")
        p.define("model_dim", 0, "Transformer model dimension.")
        p.define("num_heads", 0, "Attention heads.")
        p.define("hidden_dim", 0, "Feed-forward hidden size.")
        p.define("num_encoder_layers", 2, "Encoder layers.")
        p.define("num_decoder_layers", 2, "Decoder layers.")
        p.define("dropout_rate", 0.0, "Residual and embedding dropout.")
        p.define("label_smoothing", 0.1, "Label smoothing of the cross-entropy.")
        # The pipeline's settings (K, M, remat, schedule, devices) live only in `network`, so that an override of
        # one of them can never be shadowed by a task-level copy.
        p.define("network", None, "GPipe Params of the network; None: `network_params` of the fields above, "
                 "un-pipelined (K=1, M=1). Experiments set it so that the pipeline shows in the Params tree "
                 "(inspect) and is overridden as task.network.num_stages=..., task.network.num_micro_batches=...")
        return p

    @classmethod
    def network_params(cls, p: InstantiableParams, **pipeline: Any) -> InstantiableParams:
        """The GPipe Params of `p`'s layers (`translation_layers`), with `pipeline` settings of GPipe.params()
        (num_stages, num_micro_batches, remat, schedule, devices, ...)."""
        return GPipe.params().set(layers=translation_layers(p), **pipeline)

    def __init__(self, params: InstantiableParams, parent_path: str = "") -> None:
        super().__init__(params, parent_path)
        p = self.p
        if p.vocab_size <= 1 or p.model_dim <= 0 or p.num_heads <= 0 or p.hidden_dim <= 0:
            raise ParamsError(f"{self.path}: vocab_size, model_dim, num_heads and hidden_dim must be positive, got "
                              f"{p.vocab_size}, {p.model_dim}, {p.num_heads}, {p.hidden_dim}")
        layers = self._checked_layers(p, self.path)
        network = p.network if p.network is not None else self.network_params(p)
        self.network = self.create_child("network", network)
        (name, softmax), = self.head_params(p)
        self.softmax = self.create_head(name, softmax, self.network)
        # Global indices of the pieces in the flat list, for un-pipelined decoding; read from the list itself so
        # that a hand-edited `network` is decoded as built.
        self._e2d_index = [lp.cls for lp in layers].index(EncoderToDecoder)
        # The layer whose table embeds target ids in training, and so in decoding.
        self._target_embedder_index = 0 if p.share_embeddings else self._e2d_index
        self._decoder_indices = list(range(self._e2d_index + 1, len(layers) - 1))
        self._final_index = len(layers) - 1

    @classmethod
    def _checked_layers(cls, p: InstantiableParams, path: str) -> list[InstantiableParams]:
        """The network's layer Params, checked for the order of translation_layers and for share_embeddings."""
        layers = translation_layers(p) if p.network is None else list(p.network.layers)
        classes = [lp.cls for lp in layers]
        if (classes.count(EncoderToDecoder) != 1 or classes[0] is not SourceEmbedding
                or classes[-1] is not FinalNorm):
            raise ParamsError(f"{path}.network.layers must be SourceEmbedding, encoder blocks, one "
                              "EncoderToDecoder, decoder layers, FinalNorm; see translation_layers")
        e2d_index = classes.index(EncoderToDecoder)
        if not all(c is TransformerDecoderLayer for c in classes[e2d_index + 1:-1]):
            raise ParamsError(f"{path}.network.layers: only TransformerDecoderLayer may follow EncoderToDecoder")
        shared = bool(layers[0].embed_target)
        if shared == bool(layers[e2d_index].embed_target):
            raise ParamsError(f"{path}.network.layers: exactly one of the SourceEmbedding and the "
                              "EncoderToDecoder must have embed_target=True")
        if shared != bool(p.share_embeddings):
            # The network is spelled out, so share_embeddings alone would silently change nothing.
            raise ParamsError(f"{path}.share_embeddings={p.share_embeddings} but the network's SourceEmbedding has "
                              f"embed_target={shared}: set the network's layers to match (see translation_layers)")
        return layers

    @classmethod
    def head_params(cls, p: InstantiableParams) -> list[tuple[str, InstantiableParams]]:
        """The output softmax over the target vocabulary, which `compute_loss` runs on the network's output."""
        return [("softmax", SoftmaxCrossEntropy.params().set(input_dim=p.model_dim, num_classes=p.vocab_size,
                                                             label_smoothing=p.label_smoothing))]

    @classmethod
    def num_params(cls, p: InstantiableParams) -> int:
        """The pipeline's layers plus the softmax, from Params alone."""
        layers = cls._checked_layers(p, p.name or "translation")
        return sum(lp.cls.num_params(lp) for lp in [*layers, *(hp for _, hp in cls.head_params(p))])

    def _network_inputs(self, batch: Mapping[str, tf.Tensor]) -> tuple[tf.Tensor, ...]:
        # Paddings enter in the compute dtype, so that they travel with the activations between stages.
        return (tf.cast(batch["src_ids"], tf.int32), tf.cast(batch["src_paddings"], self.fprop_dtype),
                tf.cast(batch["tgt_in_ids"], tf.int32), tf.cast(batch["tgt_paddings"], self.fprop_dtype))

    def compute_loss(self, theta: Mapping[str, Any], batch: Mapping[str, tf.Tensor],
                     ctx: FPropContext) -> tuple[tf.Tensor, Metrics]:
        """Label-smoothed cross-entropy averaged over real target tokens; metrics: loss, token_accuracy.

        The softmax and the sums run in the pipeline's last stage (`network_and_head`), per micro-batch where the
        schedule needs it."""
        targets = {"labels": tf.cast(batch["tgt_out_ids"], tf.int32), "paddings": batch["tgt_paddings"]}
        num_tokens = tf.reduce_sum(1.0 - tf.cast(batch["tgt_paddings"], tf.float32))
        # max(., 1) keeps an all-padding batch finite; real batches always have tokens.
        denom = tf.maximum(num_tokens, 1.0)
        sums = self.network_and_head(self.network, theta["network"], self._network_inputs(batch), self._head,
                                     theta["softmax"], targets, denom, ctx)
        num_tokens, denom = (tf.cast(t, sums["loss"].dtype) for t in (num_tokens, denom))
        loss = sums["loss"] / denom
        accuracy = sums["correct"] / denom
        return loss, {"loss": (loss, num_tokens), "token_accuracy": (accuracy, num_tokens)}

    def _head(self, theta: Mapping[str, Any], features: tf.Tensor, targets: Mapping[str, tf.Tensor],
              ctx: FPropContext) -> dict[str, tf.Tensor]:
        """Summed cross-entropy and correct predictions over the real target tokens of `features`' logits."""
        logits = self.softmax.fprop(theta, features, ctx)
        xent = self.softmax.xent(logits, targets["labels"])
        weights = 1.0 - tf.cast(targets["paddings"], xent.dtype)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), targets["labels"]), xent.dtype)
        return {"loss": tf.reduce_sum(xent * weights), "correct": tf.reduce_sum(correct * weights)}

    def _layer(self, index: int) -> tuple[Any, str]:
        name = f"layer_{index}"
        return self.network.children[name], name

    def decode(self, batch: Mapping[str, tf.Tensor], max_length: int, beam_size: int = 1,
               length_penalty_alpha: float = 0.0, bos_id: int = 1, eos_id: int = 2,
               theta: Mapping[str, Any] | None = None) -> tf.Tensor:
        """Translates batch['src_ids'] (with 'src_paddings'): the best hypothesis' ids, int32 [B, max_length].

        Greedy search for beam_size=1, else beam search with GNMT's length penalty. Tokens after the first EOS
        are eos_id. Runs eagerly or inside tf.function; uses `theta` (default: this task's variables).
        """
        theta = self.cast_theta(self.theta if theta is None else theta)
        # The pipeline's layers run one by one here, so each gets its weights cast as its pipeline stage would.
        net_theta = {name: self.network.children[name].cast_theta(t) for name, t in theta["network"].items()}
        ctx = FPropContext(training=False)
        src_ids = tf.cast(batch["src_ids"], tf.int32)
        src_paddings = tf.cast(batch["src_paddings"], self.fprop_dtype)
        static_batch = src_ids.shape[0]
        batch_size = static_batch if static_batch is not None else tf.shape(src_ids)[0]

        # Encoder, un-pipelined: embedding and encoder layers on the 4-tuple (a 1-long dummy target rides along).
        dummy_ids = tf.zeros_like(src_ids[:, :1])
        state: Any = (src_ids, src_paddings, dummy_ids, tf.zeros_like(src_paddings[:, :1]))
        for j in range(self._e2d_index):
            layer, name = self._layer(j)
            state = layer.fprop(net_theta[name], state, ctx)
        e2d, e2d_name = self._layer(self._e2d_index)
        memory = e2d.encoder_memory(net_theta[e2d_name], state[0], ctx)
        embedder, embedder_name = self._layer(self._target_embedder_index)

        caches = []
        for j in self._decoder_indices:
            layer, name = self._layer(j)
            caches.append(layer.init_cache(batch_size, max_length, theta=net_theta[name], memory=memory))
        final, final_name = self._layer(self._final_index)
        initial_state = {"caches": caches, "src_paddings": src_paddings}

        def step_fn(ids_t: tf.Tensor, step_state: Any, t: tf.Tensor) -> tuple[tf.Tensor, Any]:
            positions = tf.fill(tf.shape(ids_t[:, tf.newaxis]), t)
            x = embedder.embed_target(net_theta[embedder_name], ids_t[:, tf.newaxis], positions, ctx)
            new_caches = []
            for j, cache in zip(self._decoder_indices, step_state["caches"]):
                layer, name = self._layer(j)
                x, cache = layer.extend_step(net_theta[name], x, cache, None, step_state["src_paddings"], ctx)
                new_caches.append(cache)
            x = final.normalize(net_theta[final_name], x, ctx)
            logits = self.softmax.fprop(theta["softmax"], x[:, 0], ctx)
            return tf.nn.log_softmax(logits), {"caches": new_caches, "src_paddings": step_state["src_paddings"]}

        if beam_size == 1:
            return greedy_search(step_fn, initial_state, batch_size, max_length, bos_id, eos_id)
        ids, _ = beam_search(step_fn, initial_state, batch_size, beam_size, max_length, bos_id, eos_id,
                             length_penalty_alpha=length_penalty_alpha, dtype=self.dtype)
        return ids[:, 0]
