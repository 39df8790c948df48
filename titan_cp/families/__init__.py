"""Model families behind one interface: titan_cp's Llama 3 (``llama3``) and Hugging Face causal LMs (``hf``).

:mod:`.base`: what a family answers (:class:`ModelFamily`), the registry (:func:`get_family`,
:func:`register_family`) and :class:`ModelSpec` (the model generation builds); :mod:`.init`: weights
drawn the same on any mesh, for every family's model; :mod:`.llama3`: the Llama's room (its model,
weights in and out, parallel plan and spec). The Hugging Face family (``transformers`` code) registers from
:mod:`titan_cp.integrations.hf_family`, which :mod:`titan_cp.preflight` imports.
"""

from titan_cp.config.sections import DEFAULT_FAMILY
from titan_cp.families.base import (
    ModelFamily,
    ModelSpec,
    family_names,
    family_of,
    get_family,
    register_family,
)
from titan_cp.families.llama3 import LLAMA3

__all__ = [
    "DEFAULT_FAMILY",
    "LLAMA3",
    "ModelFamily",
    "ModelSpec",
    "family_names",
    "family_of",
    "get_family",
    "register_family",
]
