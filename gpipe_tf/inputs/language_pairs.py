"""Which language directions a multilingual translation input trains on, and how a source names its target.

One model serves every direction: the source starts with a tag naming the target language ("<2fr> twenty-one"
-> "vingt et un"), as in Johnson et al. (2017) and the GPipe paper's multilingual models. Shared by the
spelled-out numbers corpus and the TFDS translation input, so both tag and choose directions the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DIRECTIONS", "ENGLISH", "language_tag", "tagged_source", "directions"]

# 'many_to_many': every ordered pair of distinct languages; 'to_from_english': English on one side (the GPipe
# paper's 102 languages to and from English); 'to_english' / 'from_english': one way only.
DIRECTIONS: tuple[str, ...] = ("many_to_many", "to_from_english", "to_english", "from_english")

ENGLISH = "en"


def language_tag(lang: str) -> str:
    """The token asking for a translation into `lang`, e.g. '<2fr>'."""
    return f"<2{lang}>"


def tagged_source(target_lang: str, source_text: str) -> str:
    """The model's source text: the target-language tag, a space, then the source, e.g. '<2fr> twenty-one'."""
    return f"{language_tag(target_lang)} {source_text}"


def directions(languages: Sequence[str], kind: str) -> list[tuple[str, str]]:
    """The (source, target) language pairs of `kind` (one of DIRECTIONS) among `languages`, in a fixed order."""
    if kind == "many_to_many":
        return [(s, t) for s in languages for t in languages if s != t]
    if kind not in DIRECTIONS:
        raise ValueError(f"directions={kind!r} is not supported; choose from {DIRECTIONS}")
    if ENGLISH not in languages:
        raise ValueError(f"directions={kind!r} needs {ENGLISH!r} among the languages, got {list(languages)}")
    others = [lang for lang in languages if lang != ENGLISH]
    from_english = [(ENGLISH, t) for t in others] if kind in ("to_from_english", "from_english") else []
    to_english = [(s, ENGLISH) for s in others] if kind in ("to_from_english", "to_english") else []
    return from_english + to_english
