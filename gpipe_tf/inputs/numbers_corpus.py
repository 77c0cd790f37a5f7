"""A many-to-many translation corpus of numbers spelled out in words by `num2words`, offline and deterministic.

Translating "<2fr> one thousand, nine hundred and eighty-four" into "mille neuf cent quatre-vingt-quatre" is a
small but real translation task: compositional, with different word orders ("einundzwanzig" puts the units
first), counting bases (French "quatre-vingt") and compounding (German, Dutch, Italian, Swedish and Finnish glue
words together), and it needs no download.

Every random choice is a hash of (seed, number, ...) rather than a draw from a shared generator, so:
- a number's split does not depend on `max_number`: growing the corpus never moves a test number into train;
- a number's pairs do not depend on which other numbers are in the list, nor on the Python or NumPy version.
"""

from __future__ import annotations

import functools
import hashlib
import unicodedata
from collections.abc import Iterable, Sequence
from numbers import Integral

from num2words import CONVERTER_CLASSES, num2words

from gpipe_tf.inputs import language_pairs
from gpipe_tf.inputs.language_pairs import DIRECTIONS, language_tag, tagged_source

__all__ = ["LANGUAGES", "DIRECTIONS", "SPLITS", "spell", "normalize", "check_language", "language_tag",
           "tagged_source", "split_numbers", "make_pairs"]

# Ten languages from four families whose num2words output is complete and mutually distinct (checked on every
# 7th number below 100,000: no two languages agree except on a few words such as "zero"): Germanic (en, de, nl,
# sv), Romance (fr, es, it, pt), Slavic (pl) and Finnic (fi). They differ in the ways that make the task
# interesting: unit-before-ten order (de, nl), base-20 words (fr), one-word compounds (de, nl, it, sv, fi),
# inflected forms (pl "tysiące"/"tysięcy", fi "tuhat"/"tuhatta"). Left out: hu (num2words writes
# "tizenkettőezer" for 12,000, not the correct "tizenkétezer"), regional variants such as pt_BR or es_CO (nearly
# the same text as pt and es) and non-Latin scripts (ru), which would mostly grow the vocabulary.
LANGUAGES: tuple[str, ...] = ("en", "fr", "de", "es", "it", "pt", "nl", "pl", "sv", "fi")

SPLITS: tuple[str, ...] = ("train", "dev", "test")

# num2words is pure Python, slowest for fr, de, nl and sv, and a corpus spells each
# (number, language) several times (as a source, as a target, for the vocabulary), and inputs for train, dev
# and test spell the same languages. 2**20 entries cover 100,000 numbers in 10 languages (about 250 MB; the
# default 10,000 numbers take a tenth of that).
_SPELL_CACHE_SIZE = 1 << 20


def normalize(text: str) -> str:
    """Canonical text: Unicode NFC (so an accent is one code point), lowercase, single spaces, no outer spaces."""
    return " ".join(unicodedata.normalize("NFC", text).lower().split())


def check_language(lang: str) -> None:
    """Raises ValueError if num2words cannot spell numbers in `lang`."""
    if lang not in CONVERTER_CLASSES:
        raise ValueError(f"language {lang!r} is not supported by num2words; choose from {sorted(CONVERTER_CLASSES)}"
                         f" (this corpus uses {list(LANGUAGES)} by default)")


@functools.lru_cache(maxsize=_SPELL_CACHE_SIZE)
def spell(number: int, lang: str) -> str:
    """`number` in words in language `lang` (a num2words code such as 'fr'), normalized; cached."""
    if isinstance(number, bool) or not isinstance(number, Integral) or number < 0:
        raise ValueError(f"number must be a non-negative int, got {number!r}")
    check_language(lang)
    return normalize(num2words(int(number), lang=lang))


def _hash_int(*parts: object) -> int:
    # A keyed hash, not random.Random: its values are fixed forever and need no shared generator state.
    text = "|".join(str(part) for part in parts)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def split_numbers(max_number: int, seed: int,
                  fractions: Sequence[float] = (0.8, 0.1, 0.1)) -> dict[str, list[int]]:
    """Assigns each number in [0, max_number) to exactly one of 'train', 'dev', 'test' (ascending lists).

    Number n goes to the split whose share of [0, 1) holds hash(seed, n) / 2**64. Split sizes are therefore
    close to `fractions` (within a few percent for a few thousand numbers) rather than exact, and a number's
    split never depends on `max_number`.
    """
    if isinstance(max_number, bool) or not isinstance(max_number, int) or max_number <= 0:
        raise ValueError(f"max_number must be a positive int, got {max_number!r}")
    if len(fractions) != len(SPLITS) or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"fractions must be {len(SPLITS)} non-negative numbers (for {SPLITS}) summing to 1, "
                         f"got {tuple(fractions)}")
    bounds = [sum(fractions[:i + 1]) * 2**64 for i in range(len(SPLITS) - 1)]
    splits: dict[str, list[int]] = {name: [] for name in SPLITS}
    for number in range(max_number):
        position = _hash_int("split", seed, number)
        index = sum(position >= bound for bound in bounds)
        splits[SPLITS[index]].append(number)
    return splits


def make_pairs(numbers: Iterable[int], languages: Sequence[str], seed: int, pairs_per_number: int,
               directions: str = "many_to_many") -> list[tuple[str, str, str, str]]:
    """Translation examples (source_lang, target_lang, source_text, target_text), `pairs_per_number` per number.

    Each number gets that many distinct (source, target) language directions, source != target, drawn without
    replacement from all directions allowed by `directions` (one of language_pairs.DIRECTIONS, e.g.
    'many_to_many': every ordered pair of `languages`, or 'to_from_english': English on one side). Examples come
    number by number in the order of `numbers`; the draws depend only on (seed, number, the order of `languages`).
    """
    languages = list(languages)
    if len(set(languages)) != len(languages) or len(languages) < 2:
        raise ValueError(f"languages must be at least 2 distinct codes, got {languages}")
    for lang in languages:
        check_language(lang)
    allowed = language_pairs.directions(languages, directions)
    if isinstance(pairs_per_number, bool) or not isinstance(pairs_per_number, int) or not (
            1 <= pairs_per_number <= len(allowed)):
        raise ValueError(f"pairs_per_number must be an int in [1, {len(allowed)}] (the number of {directions} "
                         f"directions among {len(languages)} languages), got {pairs_per_number!r}")
    pairs = []
    for number in numbers:
        order = list(range(len(allowed)))
        # A partial Fisher-Yates shuffle: the first pairs_per_number entries become a uniform sample without
        # replacement, so one number is never translated twice in the same direction.
        for k in range(pairs_per_number):
            j = k + _hash_int("pair", seed, number, k) % (len(allowed) - k)
            order[k], order[j] = order[j], order[k]
            source, target = allowed[order[k]]
            pairs.append((source, target, spell(number, source), spell(number, target)))
    return pairs
