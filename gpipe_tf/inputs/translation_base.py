"""What every translation input gives a translation task: tagged id batches, a vocabulary and references.

Inputs differ in where sentences come from (the spelled-out numbers corpus, TFDS TED or WMT) but share the
batch dict that TranslationTask reads, the SentencePiece vocabulary learned from their training text (and the
Params that choose it, see text_base.TextInput), and `references()` for --mode=decode.
"""

from __future__ import annotations

from gpipe_tf.inputs.text_base import TextInput


class TranslationInput(TextInput):
    """Base class of translation inputs.

    Every batch is a dict of
      'src_ids'       int32 [B, S]  the tagged source's ids ('<2fr> twenty-one'), no bos or eos;
      'src_paddings'  float32 [B, S]  1.0 where padded (there src_ids is pad_id 0);
      'tgt_in_ids'    int32 [B, T]  bos, then the target's ids (decoder input);
      'tgt_out_ids'   int32 [B, T]  the target's ids, then eos (labels: tgt_in_ids shifted left by one);
      'tgt_paddings'  float32 [B, T]  1.0 where padded (there both target ids are 0);
      'tgt_lang'      string [B]  target language code, for per-language metrics;
    with a static batch size B and S, T <= `max_length`. Subclasses set `self.vocab` (see `_load_vocabulary`).
    """

    def references(self) -> list[tuple[str, str, str]]:
        """(tagged source text, target text, target language) per example, in the order batches yield them."""
        raise NotImplementedError(f"{type(self).__name__}.references")
