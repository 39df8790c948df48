"""Tiny random Hugging Face model folders, built offline: what ``save_pretrained`` writes, nothing
downloaded. The examples (``examples/``) train them when no ``MODEL`` folder is given; the tests use them.

::

    path = tiny_qwen3_folder(tempfile.mkdtemp())   # config.json, model.safetensors, tokenizer files
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="titan_cp")
    tokenizer = AutoTokenizer.from_pretrained(path)

The same ``seed`` gives the same weights and tokenizer in every process; build the folder before the
process group starts (``save_pretrained`` then writes on rank 0 only).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_TEXT = ["the ring passes keys and values around the ranks", "Remember these facts. Recall the key.", "<tool>ls</tool>"]


def byte_tokenizer(path: str | Path, vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE ``tokenizer.json`` (every text encodes; BOS ``<s>``, EOS/PAD ``</s>``) saved
    with its ``tokenizer_config.json`` in ``path`` by ``PreTrainedTokenizerFast``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(str(path))
    return fast


def tiny_qwen3_folder(path: str | Path, seed: int = 0, tied: bool = True, dtype: Any = torch.float32) -> Path:
    """A random tiny ``Qwen3ForCausalLM`` (q/k norms; tied embeddings by default; weights ~ N(0, 0.2),
    norms ~ 1 + N(0, 0.2)) with a byte-level tokenizer, written with ``save_pretrained`` to ``path``."""
    fields = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    return _tiny_folder(path, ("Qwen3Config", "Qwen3ForCausalLM"), fields, seed, dtype)


def tiny_qwen35_folder(path: str | Path, seed: int = 0, dtype: Any = torch.float32) -> Path:
    """A random tiny ``Qwen3_5ForCausalLM``: Qwen3.5's hybrid of Gated DeltaNet (linear attention, layers 0,
    2 and 3) and gated full attention (layer 1), 4 layers, otherwise as :func:`tiny_qwen3_folder`."""
    fields = dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        tie_word_embeddings=True,
    )  # fmt: skip
    return _tiny_folder(path, ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"), fields, seed, dtype)


def _tiny_folder(path: str | Path, classes: tuple[str, str], fields: dict[str, Any], seed: int, dtype: Any) -> Path:
    """``classes``: the ``transformers`` config and model class names."""
    import transformers  # noqa: PLC0415

    path = Path(path)
    tokenizer = byte_tokenizer(path)
    config = getattr(transformers, classes[0])(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "max_position_embeddings": 4096,
            **fields,
        }
    )
    torch.manual_seed(seed)
    model = getattr(transformers, classes[1])(config)
    with torch.no_grad():  # weights large enough that attention is far from uniform: positions and masks show
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) + (1.0 if "norm" in name else 0.0))
    model.to(dtype).save_pretrained(str(path))
    if not (path / "config.json").exists():
        raise ValueError(
            f"a tiny folder at {str(path)!r}: transformers' save_pretrained writes on rank 0 only once a process "
            "group has started; build the folder in every process before init_process_group / init_device_mesh"
        )
    return path
