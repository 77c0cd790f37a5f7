"""TED multilingual translation: the GPipe paper's multilingual setting, as far as TED talks allow.

The paper trains one Transformer on 102 languages to and from English. TFDS `ted_multi_translate` (TED talk
transcripts aligned across 60 language codes, Qi et al. 2018; each sentence holds the translations that exist
for it, several million sentence pairs with English in all) is the widest such corpus TFDS prepares by itself.
TedMultiBig translates between English and every other TED language, both ways (59 x 2 = 118 directions, each
source tagged with its target, "<2fr> thank you" -> "merci"), with the T(6, 8192, 16) model of
params/mt/gpipe_paper.py unchanged and a 64k SentencePiece vocabulary learned from the first million train
texts. Dev and test are TED's validation and test splits (their first `eval_batches` batches).

Data: prepare once where there is internet with `tfds build ted_multi_translate --data_dir=DIR`, copy DIR
here if needed, and point the experiment at it: `--gin_param="TedMultiBig.data_dir='DIR'"`. Without it the
inputs fail at once with DatasetNotPreparedError. The vocabulary is trained on first use (minutes) into
`vocab_dir` (default: a shared cache folder, see params/mt/number_words.py) and reused after that.

WMT: the same model and inputs read a WMT config instead with `--gin_param="TedMultiBig.dataset=
'wmt14_translate/de-en'"` (German <-> English, tags <2de> and <2en>); see TfdsTranslationInputs.
"""

from __future__ import annotations

from gpipe_tf import model_registry
from gpipe_tf.hyperparams import InstantiableParams
from gpipe_tf.params.mt.gpipe_paper import T6_8192_16
from gpipe_tf.params.mt.number_words import default_vocab_dir


class TfdsTranslationInputs:
    """TFDS translation inputs for a translation experiment (a mixin, listed before the experiment's class).

    Sizes shared with the model (vocab_size, max_length, batch_size, vocab_dir) are the experiment's own knobs.
    The `dataset` knob also takes a WMT config, e.g. 'wmt14_translate/de-en' (languages None: both of the pair),
    or 'wmt_translate/<xx>-<yy>' with `wmt_subsets` (see gpipe_tf/inputs/tfds_translation.py).
    """

    dataset = "ted_multi_translate"
    wmt_subsets = None
    data_dir = None  # TFDS data_dir holding the prepared dataset; None: TFDS's default
    languages = None  # language codes, in tag order; None: all of the dataset's (TED: 60)
    directions = "to_from_english"  # see gpipe_tf/inputs/language_pairs.py
    vocab_max_sentences = 1_000_000
    eval_batches = 10

    def _tfds_input(self, split: str, num_batches: int | None) -> InstantiableParams:
        from gpipe_tf.inputs.tfds_translation import TfdsTranslationInput

        return TfdsTranslationInput.params().set(
            dataset=self.dataset, wmt_subsets=self.wmt_subsets, split=split, data_dir=self.data_dir,
            languages=self.languages, directions=self.directions, vocab_size=self.vocab_size,
            max_length=self.max_length, vocab_dir=self.vocab_dir or default_vocab_dir(),
            vocab_max_sentences=self.vocab_max_sentences, batch_size=self.batch_size, num_batches=num_batches)

    def train_input(self) -> InstantiableParams:
        """The train split: shuffled, repeated forever, bucketed by length."""
        return self._tfds_input("train", None)

    def dev_input(self) -> InstantiableParams:
        """The first `eval_batches` batches of the validation split, in file order."""
        return self._tfds_input("validation", self.eval_batches)

    def test_input(self) -> InstantiableParams:
        """The first `eval_batches` batches of the test split, in file order."""
        return self._tfds_input("test", self.eval_batches)


@model_registry.register
class TedMultiBig(TfdsTranslationInputs, T6_8192_16):
    """T(6, 8192, 16) ("Transformer Big", paper: 400M) on TED, English <-> 59 languages (see the module doc)."""
