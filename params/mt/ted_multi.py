"""TED multilingual translation experiments (the GPipe paper's multilingual setting), Params only for now.

The TFDS `ted_multi_translate` input generator does not exist yet: the inputs are NumbersTiny's placeholders
(NumbersTranslationInput Params), so these experiments are for `--mode=inspect` until that input is written.
"""

from __future__ import annotations

import model_registry
from params.mt.gpipe_paper import T6_8192_16


@model_registry.register
class TedMultiBig(T6_8192_16):
    """T(6, 8192, 16) ("Transformer Big") for TED multilingual; inputs are placeholders (see the module doc)."""
