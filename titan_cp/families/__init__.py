"""Model families behind one interface: titan_cp's Llama 3 (``llama3``) and Hugging Face causal LMs (``hf``).

:mod:`.base`: what a family answers (:class:`ModelFamily`), the registry (:func:`get_family`,
:func:`register_family`) and :class:`ModelSpec` (the model generation builds);
:mod:`.llama3` and :mod:`.huggingface`: the two built in.
"""

from titan_cp.families.base import (
    DEFAULT_FAMILY,
    ModelFamily,
    ModelSpec,
    family_names,
    family_of,
    get_family,
    register_family,
)
from titan_cp.families.huggingface import HF
from titan_cp.families.llama3 import LLAMA3

__all__ = [
    "DEFAULT_FAMILY",
    "HF",
    "LLAMA3",
    "ModelFamily",
    "ModelSpec",
    "family_names",
    "family_of",
    "get_family",
    "register_family",
]
