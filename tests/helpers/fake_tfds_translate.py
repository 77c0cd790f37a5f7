"""Tiny fake source files for the real TFDS translation builders (TED multilingual, WMT), to prepare offline.

The writers lay files out exactly as the builders of tensorflow-datasets 4.9 read them after download and
extraction (`datasets/ted_multi_translate/ted_multi_translate_dataset_builder.py`, `translate/wmt.py`); the
sentences are numbers spelled out by num2words, so every language has real, distinct text. Prepare with
`fake_tfds.prepare_offline(builder, source_dir)`, which patches the download manager to return source_dir.
"""

from __future__ import annotations

import os

import tensorflow_datasets as tfds
from num2words import num2words

# TED's code -> num2words' code.
TED_LANGUAGES = {"en": "en", "fr": "fr", "de": "de", "es": "es", "pt-br": "pt_BR"}
# The TED files' marker of a missing translation (the builder drops such entries).
TED_MISSING = "__NULL__"
# A sentence with capitals, a combining accent (NFD) and a double space: the input must NFC-normalize it and
# collapse the spaces, but keep the case.
TED_GREETING = {"en": "Thank  you very much.", "fr": "Merci beaucoup, Chris.", "de": "Vielen Dank.",
                "es": "Muchas gracias, Chris.", "pt-br": "Muito obrigado, Chris. E\u0301 isso."}
TED_SPLIT_FILES = {"train": "all_talks_train.tsv", "validation": "all_talks_dev.tsv",
                   "test": "all_talks_test.tsv"}


def spell(number: int, lang: str) -> str:
    """`number` in words in TED language `lang`."""
    return num2words(number, lang=TED_LANGUAGES.get(lang, lang))


def ted_sentence(number: int) -> dict[str, str]:
    """The translations of TED sentence `number`: every language, but German misses every 4th and Brazilian
    Portuguese every 3rd (TED talks hold varying sets of languages)."""
    return {lang: spell(number, lang) for lang in TED_LANGUAGES
            if not (lang == "de" and number % 4 == 0) and not (lang == "pt-br" and number % 3 == 0)}


def ted_corpus() -> dict[str, list[dict[str, str]]]:
    """Per split, the sentences (language -> raw text) written by `write_ted_multi` by default."""
    return {"train": [TED_GREETING] + [ted_sentence(n) for n in range(1, 31)],
            "validation": [TED_GREETING] + [ted_sentence(n) for n in range(31, 37)],
            "test": [ted_sentence(n) for n in range(37, 43)]}


def write_ted_multi(root: str, corpus: dict[str, list[dict[str, str]]] | None = None) -> dict:
    """Writes the extracted ted_talks.tar.gz (all_talks_{train,dev,test}.tsv) under `root`; returns the corpus.

    Each file has a header 'talk_name', then one column per language; a missing translation is __NULL__.
    """
    corpus = corpus or ted_corpus()
    languages = sorted({lang for sentences in corpus.values() for sentence in sentences for lang in sentence})
    os.makedirs(root, exist_ok=True)
    for split, sentences in corpus.items():
        with open(os.path.join(root, TED_SPLIT_FILES[split]), "w", encoding="utf-8") as f:
            f.write("\t".join(["talk_name", *languages]) + "\n")
            for i, sentence in enumerate(sentences):
                f.write("\t".join([f"talk_{i // 4}", *(sentence.get(lang, TED_MISSING) for lang in languages)]) + "\n")
    return corpus


def _write_sgm(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write('<srcset setid="fake" srclang="any">\n<doc docid="fake" genre="news">\n')
        f.writelines(f'<seg id="{i + 1}">{line}</seg>\n' for i, line in enumerate(lines))
        f.write("</doc>\n</srcset>\n")


def write_wmt(root: str, builder: tfds.core.DatasetBuilder, per_subset: int = 6) -> dict[str, list[tuple[str, str]]]:
    """Writes every sub-dataset file that `builder` (a WMT config) reads, under `root`.

    All of the builder's URLs resolve to `root` (fake_tfds.offline_downloads), so each file lies at the
    sub-dataset's relative path: parallel text files (one sentence a line) or SGML (.sgm, one <seg> a line).
    Sub-dataset k holds numbers 100k+1 .. 100k+per_subset. Returns {split: [(source text, target text)]}.
    """
    from tensorflow_datasets.translate import wmt

    source, target = builder.builder_config.language_pair
    written: dict[str, list[tuple[str, str]]] = {}
    for k, (split, name) in enumerate((s, n) for s, names in builder.subsets.items() for n in names):
        numbers = range(100 * k + 1, 100 * k + 1 + per_subset)
        pairs = [(spell(n, source), spell(n, target)) for n in numbers]
        written.setdefault(str(split), []).extend(pairs)
        paths = wmt.DATASET_MAP[name].get_path(source)
        if len(paths) != 2:
            raise ValueError(f"{name}: only parallel text or SGML files are faked, not {paths}")
        for path, lines in zip(paths, zip(*pairs)):
            full = os.path.join(root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            if path.endswith(".sgm"):
                _write_sgm(full, list(lines))
            else:
                with open(full, "w", encoding="utf-8") as f:
                    f.write("\n".join(lines) + "\n")
    return written
