"""Llama 3 family model with torchtitan's parameter names; ``hf``: Hugging Face checkpoints in and out."""

from titan_cp.model import hf_checkpoint
from titan_cp.model.flavors import FLAVORS, build_model, model_args
from titan_cp.model.llama import (
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

__all__ = [
    "FLAVORS",
    "Attention",
    "FeedForward",
    "InnerAttention",
    "ModelArgs",
    "RoPEScaling",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "build_model",
    "hf_checkpoint",
    "model_args",
    "rope_cos_sin",
    "rope_frequencies",
]
