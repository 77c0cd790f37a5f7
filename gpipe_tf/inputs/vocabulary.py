"""A subword vocabulary learned from training text with SentencePiece, saved as `<prefix>.model` with the run.

Ids are fixed whatever the text: pad 0, eos 1, bos 2, unk 3, then the user symbols (e.g. language tags) in
the order given, then the learned pieces. The model type is BPE by default: SentencePiece's BPE trainer is
faster than its unigram trainer on spelled-out numbers, gives slightly shorter sequences on that text, and is the
closest SentencePiece kind to the word pieces of the GPipe paper's translation models. 'unigram' stays
available.

Training is deterministic: one thread (the unigram trainer's multi-threaded sums depend on the thread count),
no sentence shuffling, a hash-based subsample when there is more text than `max_sentences`, and the model bytes
hold no file names (the model is serialized in memory and written by this module), so the same texts always
give a byte-identical `.model` file. `load_or_train` relies on that to cache a vocabulary under a name derived
from everything that shaped its text, so train, dev and test inputs (and later runs) share one trained model.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence

import sentencepiece as spm
from absl import logging
from sentencepiece import sentencepiece_model_pb2

from gpipe_tf.errors import ConfigError

__all__ = ["Vocabulary", "load_or_train", "PAD_ID", "EOS_ID", "BOS_ID", "UNK_ID"]

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3

# SentencePiece's whitespace marker. A user symbol such as '<2fr>' always starts the text or follows a space,
# so SentencePiece sees '▁<2fr>'; storing the symbol as the piece '▁<2fr>' makes it one token instead of two
# ('▁', '<2fr>'), and decoding still gives back '<2fr>' with its space.
_SPACE = "\u2581"
_MODEL_TYPES = ("bpe", "unigram")


def _subsample(texts: list[str], max_sentences: int) -> list[str]:
    # Keeps the texts whose hash is smallest: unlike a stride, this cannot lock onto a pattern in the text
    # order (every 10th sentence of a corpus listed number by number in 10 languages is one language).
    keys = sorted(range(len(texts)),
                  key=lambda i: hashlib.blake2b(f"{i}|{texts[i]}".encode(), digest_size=8).digest())
    return [texts[i] for i in sorted(keys[:max_sentences])]


def _write_atomically(path: str, data: bytes) -> None:
    # Several inputs of one run (train, dev, test) may train the same vocabulary at once; readers must never
    # see a half-written model.
    handle, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a saved vocabulary is meant to be shared with the run
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Vocabulary:
    """A SentencePiece model: text <-> ids, with fixed special ids and single-token user symbols."""

    def __init__(self, processor: spm.SentencePieceProcessor, model_path: str | None = None) -> None:
        specials = {"pad": (processor.pad_id(), PAD_ID), "eos": (processor.eos_id(), EOS_ID),
                    "bos": (processor.bos_id(), BOS_ID), "unk": (processor.unk_id(), UNK_ID)}
        wrong = {name: got for name, (got, want) in specials.items() if got != want}
        if wrong:
            raise ValueError(f"SentencePiece model {model_path or '(in memory)'} has special ids {wrong}; this "
                             f"project needs pad={PAD_ID}, eos={EOS_ID}, bos={BOS_ID}, unk={UNK_ID} (train it "
                             "with Vocabulary.train)")
        self._processor = processor
        self._model_path = model_path
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(processor.serialized_model_proto())
        user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
        self._symbols = {piece.piece[1:] if piece.piece.startswith(_SPACE) else piece.piece: i
                         for i, piece in enumerate(proto.pieces) if piece.type == user_defined}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, path_prefix: str, user_symbols: Sequence[str] = (),
              model_type: str = "bpe", max_sentences: int | None = None) -> Vocabulary:
        """Learns a vocabulary of exactly `vocab_size` ids from `texts` and saves it at `path_prefix`.

        Writes `<path_prefix>.model` (what `load` reads) and `<path_prefix>.vocab` (one 'piece<TAB>score' line
        per id, for people).
        `user_symbols` (e.g. language tags '<2fr>') become single tokens wherever they start the text or follow
        a space. `max_sentences` caps the training text with a deterministic subsample; None uses it all.
        Every character of the texts is kept (character coverage 1.0), so the texts encode without unknowns.
        """
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported; choose from {_MODEL_TYPES}")
        symbols = list(user_symbols)
        bad = [s for s in symbols if not s or s != s.strip() or len(s.split()) != 1 or _SPACE in s]
        if bad or len(set(symbols)) != len(symbols):
            raise ValueError(f"user_symbols must be distinct, non-empty and free of whitespace, got {symbols}")
        texts = [t for t in texts if t]
        if not texts:
            raise ValueError("cannot train a vocabulary on no text")
        if max_sentences is not None and len(texts) > max_sentences:
            texts = _subsample(texts, max_sentences)
        min_size = UNK_ID + 1 + len(symbols) + 1
        if vocab_size < min_size:
            raise ValueError(f"vocab_size={vocab_size} is too small: the 4 special ids and {len(symbols)} user "
                             f"symbols alone take {min_size - 1}")
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type=model_type,
                character_coverage=1.0, pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
                user_defined_symbols=[_SPACE + s for s in symbols],
                # Text is normalized by whoever makes it (e.g. numbers_corpus.normalize); the vocabulary must
                # not change it again, or decode(encode(x)) would differ from x.
                normalization_rule_name="identity",
                num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2)
        except RuntimeError as e:
            limit = re.search(r"Vocabulary size too high.*?<= *(\d+)", str(e))
            if limit:
                raise ValueError(f"vocab_size={vocab_size} is too large for these {len(texts)} training sentences "
                                 f"(SentencePiece can make at most {limit.group(1)} ids from them): lower "
                                 "vocab_size or train on more text") from None
            raise
        vocab = cls(spm.SentencePieceProcessor(model_proto=model.getvalue()), f"{path_prefix}.model")
        parent = os.path.dirname(os.path.abspath(path_prefix))
        os.makedirs(parent, exist_ok=True)
        _write_atomically(f"{path_prefix}.model", model.getvalue())
        processor = vocab._processor
        listing = "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n" for i in range(vocab.size))
        _write_atomically(f"{path_prefix}.vocab", listing.encode("utf-8"))
        return vocab

    @classmethod
    def load(cls, model_path: str) -> Vocabulary:
        """Reads a `.model` file written by `train` (or any SentencePiece model with this project's special ids)."""
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"no SentencePiece model at {model_path!r}")
        return cls(spm.SentencePieceProcessor(model_file=model_path), model_path)

    @property
    def model_path(self) -> str | None:
        """Where the model was loaded from or written to."""
        return self._model_path

    @property
    def size(self) -> int:
        """Number of ids, special ids and user symbols included (the softmax size)."""
        return self._processor.get_piece_size()

    @property
    def pad_id(self) -> int:
        """Id of padding (0)."""
        return PAD_ID

    @property
    def eos_id(self) -> int:
        """Id of end of sentence (1)."""
        return EOS_ID

    @property
    def bos_id(self) -> int:
        """Id of beginning of sentence (2)."""
        return BOS_ID

    @property
    def unk_id(self) -> int:
        """Id of unknown pieces (3)."""
        return UNK_ID

    def serialized_model(self) -> bytes:
        """The model file's bytes."""
        return self._processor.serialized_model_proto()

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without bos or eos."""
        return self._processor.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text (SentencePiece encodes a list much faster than one text at a time)."""
        return self._processor.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, up to the first eos; pad and bos are skipped (so model output decodes as is)."""
        kept = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                kept.append(i)
        return self._processor.decode(kept)

    def id_to_piece(self, token_id: int) -> str:
        """The piece of an id, e.g. '▁mil'; a user symbol without its whitespace marker, e.g. '<2fr>'."""
        piece = self._processor.id_to_piece(int(token_id))
        return piece[1:] if self._symbols.get(piece[1:]) == int(token_id) else piece

    @property
    def user_symbols(self) -> list[str]:
        """The user symbols (e.g. language tags) in id order."""
        return list(self._symbols)

    def symbol_id(self, symbol: str) -> int:
        """The single id of a user symbol such as '<2fr>'; KeyError if the vocabulary was not trained with it."""
        if symbol not in self._symbols:
            raise KeyError(f"{symbol!r} is not a user symbol of vocabulary {self._model_path or '(in memory)'}; "
                           f"it has {self.user_symbols}")
        return self._symbols[symbol]


def load_or_train(model_path: str | None, vocab_dir: str | None, name: str, setting: object,
                  texts: Callable[[], list[str]], vocab_size: int, user_symbols: Sequence[str],
                  max_sentences: int | None) -> Vocabulary:
    """The vocabulary of a translation input, with every one of `user_symbols` (language tags) a single token.

    With `model_path` set, loads that model. Otherwise reuses `<vocab_dir>/<name>_bpe<vocab_size>_<digest>.model`
    if an earlier input trained it (training is deterministic, so it is the model we would get), or trains it
    from `texts()` (called only then) and saves it there. The digest hashes `repr(setting)`: put into `setting`
    everything that changes the training text (corpus version, languages, sample size), so different text never
    reuses a model. Errors are ConfigErrors that say which setting to change.
    """
    if model_path:
        vocab = Vocabulary.load(model_path)
    else:
        digest = hashlib.sha256(repr((setting, list(user_symbols), max_sentences)).encode("utf-8")).hexdigest()
        prefix = os.path.join(vocab_dir, f"{name}_bpe{vocab_size}_{digest[:12]}")
        if os.path.isfile(prefix + ".model"):
            return Vocabulary.load(prefix + ".model")
        sentences = texts()
        try:
            vocab = Vocabulary.train(sentences, vocab_size, prefix, user_symbols, max_sentences=max_sentences)
        except ValueError as e:
            raise ConfigError(f"cannot train the vocabulary (vocab_size={vocab_size}, {len(sentences)} training "
                              f"sentences): {e}") from None
        logging.info("Trained a %d-id vocabulary on %d sentences: %s", vocab.size,
                     min(len(sentences), max_sentences or len(sentences)), vocab.model_path)
    for symbol in user_symbols:
        try:
            vocab.symbol_id(symbol)
        except KeyError as e:
            raise ConfigError(f"vocab_model={vocab.model_path!r} cannot be used here: {e.args[0]}") from None
    return vocab
