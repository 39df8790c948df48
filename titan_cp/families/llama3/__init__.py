"""``model.name = "llama3"``: titan_cp's Llama 3, in one room with its parallel plan and its family spec.

:mod:`.model` (the transformer, torchtitan's parameter names) and :mod:`.flavors`; weights in and out:
:mod:`.hf_checkpoint` (Hugging Face folders), :mod:`.torchtitan_checkpoint` (torchtitan's DCP names);
its parallel plan: :mod:`.parallelize` (the adapter the ``apply_*`` functions see it through, its CP
binding, :class:`LlamaBuilder`), :mod:`.tp` (tensor parallel), :mod:`.pp` (pipeline split);
:mod:`.family`: the family spec (:data:`LLAMA3`).
"""

from titan_cp.families.llama3 import hf_checkpoint
from titan_cp.families.llama3.family import LLAMA3, Llama3
from titan_cp.families.llama3.flavors import FLAVORS, build_model, model_args
from titan_cp.families.llama3.model import (
    Attention,
    FeedForward,
    InnerAttention,
    ModelArgs,
    RoPEScaling,
    Transformer,
    TransformerBlock,
    apply_rotary_emb,
    rope_cos_sin,
    rope_frequencies,
)
from titan_cp.families.llama3.parallelize import LlamaBuilder, materialize, parallelize_llama
from titan_cp.families.llama3.pp import pipeline_llama, split_stage
from titan_cp.families.llama3.tp import apply_tp

__all__ = [
    "FLAVORS",
    "LLAMA3",
    "Attention",
    "FeedForward",
    "InnerAttention",
    "Llama3",
    "LlamaBuilder",
    "ModelArgs",
    "RoPEScaling",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "apply_tp",
    "build_model",
    "hf_checkpoint",
    "materialize",
    "model_args",
    "parallelize_llama",
    "pipeline_llama",
    "rope_cos_sin",
    "rope_frequencies",
    "split_stage",
]
