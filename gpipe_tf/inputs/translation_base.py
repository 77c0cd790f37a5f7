"""What every translation input gives a translation task: tagged id batches, a vocabulary and references.

Inputs differ in where sentences come from (the spelled-out numbers corpus, TFDS TED or WMT) but share the
batch dict that TranslationTask reads, the SentencePiece vocabulary learned from their training text (and the
Params that choose it), and `references()` for --mode=decode.
"""

from __future__ import annotations

from typing import Callable, Sequence

from gpipe_tf.hyperparams import InstantiableParams, ParamsError
from gpipe_tf.inputs.base_input import BaseInput
from gpipe_tf.inputs.language_pairs import language_tag
from gpipe_tf.inputs.vocabulary import Vocabulary, load_or_train


class TranslationInput(BaseInput):
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

    vocab: Vocabulary

    @classmethod
    def params(cls) -> InstantiableParams:
        """Default Params: BaseInput's, plus the vocabulary's."""
        p = super().params()
        p.define("vocab_model", None, "Path of a SentencePiece .model to use; None trains one into vocab_dir "
                 "from the train split's text (or reuses the one an identical setting trained there).")
        p.define("vocab_dir", None, "Where to train the vocabulary when vocab_model is None, e.g. the logdir "
                 "(unused when vocab_model is set).")
        p.define("vocab_size", 1000, "Ids in a trained vocabulary (special ids and language tags included).")
        p.define("vocab_max_sentences", 200_000, "At most this many train sentences train the vocabulary "
                 "(None = all); bounds its training time. Which ones: see the input's doc.")
        return p

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        if self.p.vocab_model is None and self.p.vocab_dir is None:
            raise ParamsError("set vocab_model (a trained SentencePiece .model) or vocab_dir (where to train one, "
                              "e.g. the logdir); both are None")

    def _load_vocabulary(self, name: str, setting: object, texts: Callable[[], list[str]],
                         languages: Sequence[str]) -> Vocabulary:
        """vocab_model, or the vocabulary learned from `texts()` with a `<2xx>` tag per language; see
        vocabulary.load_or_train for `name` and `setting`."""
        p = self.p
        return load_or_train(p.vocab_model, p.vocab_dir, name, setting, texts, p.vocab_size,
                             [language_tag(lang) for lang in languages], p.vocab_max_sentences)

    def references(self) -> list[tuple[str, str, str]]:
        """(tagged source text, target text, target language) per example, in the order batches yield them."""
        raise NotImplementedError(f"{type(self).__name__}.references")
