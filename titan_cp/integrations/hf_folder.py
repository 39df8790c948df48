"""The trainer's Hugging Face models (``model.name = "hf"``): a folder in, a folder out.

``model.hf_assets_path`` names a local Hugging Face model folder (``config.json``, tokenizer,
``*.safetensors``). The trainer (``titan_cp.train``) then, as for its own Llama:

1. checks before any process group starts (:func:`check_job`): the folder and its
   ``config.json``, the family's attention (:func:`.hf_model.check_supported`, on a ``meta``
   model), the heads against the CP degree;
2. builds the model on ``meta`` (no memory), makes it context-parallel (:func:`.transformers.apply_cp`),
   wraps it in :class:`.hf_parallel.CausalLM` (titan_cp's model contract and chunked loss),
   applies activation checkpointing, ``torch.compile`` and FSDP2 over ``dp_shard x cp``, then
   allocates each rank's shards (``to_empty``) and restores the buffers ``transformers`` computes
   at construction (RoPE frequencies) with the model's own ``_init_weights``
   (:func:`build_parallel_hf_model`, through :func:`titan_cp.parallel.build.build_parallel_model`);
3. loads the weights shard by shard (``checkpoint.initial_load_path`` with
   ``checkpoint.initial_load_in_hf``): every rank reads only its slices of the safetensors, by
   ``transformers``' own parameter names, after checking every name and shape (:func:`load_hf_weights`);
4. saves DCP checkpoints under the same names (``titan_cp.checkpoint``: they resume on another
   mesh), and with ``checkpoint.last_save_in_hf`` exports a folder that ``from_pretrained`` reads:
   safetensors consolidated from every rank's shards, ``config.json`` and the tokenizer files
   (:func:`save_weights`).

TP and PP are not built for these models: the config refuses them, naming the key.
"""

from __future__ import annotations

import copy
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from titan_cp.attention.handle import CPHandle
from titan_cp.errors import UserError, process_rank
from titan_cp.families.llama3.hf_checkpoint import file_index, write_hf_folder
from titan_cp.files import read_json
from titan_cp.integrations.hf_model import check_supported, hf_model_of, text_config
from titan_cp.integrations.hf_parallel import CausalLM
from titan_cp.integrations.transformers import ATTN_IMPLEMENTATION, apply_cp
from titan_cp.parallel import build as parallel_build
from titan_cp.parallel.build import ModelBuilder

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_WEIGHTS = re.compile(r"^(config\.json|model\.safetensors\.index\.json|.*\.(safetensors|bin|pt|pth))$")


@dataclass(frozen=True)
class HFModelArgs:
    """What the trainer's metrics ask of a model's shapes, read from an HF model: ``training_flops``."""

    n_layers: int
    n_heads: int
    head_dim: int
    matmul_params: int  # parameters used in matmuls: all but an untied input embedding

    @classmethod
    def of(cls, model: Any) -> HFModelArgs:  # a transformers PreTrainedModel
        c = text_config(model.config)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        total = sum(p.numel() for p in model.parameters())  # a tied weight once
        lookup = 0 if head is not None and head.weight is embed.weight else embed.weight.numel()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.num_hidden_layers, c.num_attention_heads, head_dim, total - lookup)

    def training_flops(self, num_tokens: int, attention_pairs: int) -> int:
        """``6 N`` per token for the matmuls plus ``12 head_dim`` per head, layer and visible
        (query, key) pair, as ``titan_cp.families.llama3.ModelArgs.training_flops`` counts them."""
        return 6 * self.matmul_params * num_tokens + 12 * self.n_layers * self.n_heads * self.head_dim * attention_pairs


def hf_folder(path: str | Path | None, key: str = "model.hf_assets_path") -> Path:
    """``path`` as a Hugging Face model folder holding ``config.json``; ``ValueError`` naming ``key``."""
    folder = Path(path) if path else None
    if folder is None or not folder.is_dir():
        raise ValueError(f"{key} = {path!r} is not a folder: give a local Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{key} = {str(path)!r} holds no config.json: model.name = 'hf' builds the model from a Hugging Face "
            "folder's config.json (save_pretrained writes one)"
        )
    return folder


def load_hf_config(path: str | Path | None, key: str = "model.hf_assets_path") -> PretrainedConfig:
    """The ``transformers`` config of the folder ``path`` (read locally; nothing is downloaded). A
    ``config.json`` that is not a JSON object, or that transformers cannot read (no or an unknown
    ``model_type``), is a ``UserError`` naming ``key`` and the file."""
    from transformers import AutoConfig  # noqa: PLC0415 - optional dependency

    folder = hf_folder(path, key)
    where = f"{key} = {str(path)!r}: config.json"
    if not isinstance(read_json(folder / "config.json", where), dict):
        raise UserError(f"{where} must hold a JSON object (the model's configuration)")
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{where} cannot be read by transformers: {first}") from None


def meta_model(config: PretrainedConfig) -> Any:  # a transformers PreTrainedModel
    """The causal LM of ``config`` on the ``meta`` device, attention ``titan_cp``, fp32 parameters."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)


def check_job(cfg: Any) -> None:
    """What the HF folder can tell before any process starts: ``config.json``, a supported attention,
    heads the CP strategy can split. ``ValueError`` naming the key."""
    try:
        config = load_hf_config(cfg.model.hf_assets_path)
        model = meta_model(config)
    except ImportError as e:
        raise ValueError("model.name = 'hf' needs the transformers package: pip install transformers") from e
    try:
        check_supported(model)
    except ValueError as e:
        raise ValueError(f"model.hf_assets_path = {cfg.model.hf_assets_path!r}: {e}") from None
    p, c = cfg.parallelism, text_config(config)
    q, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    s, cp, u = p.strategy(), p.context_parallel_degree, p.context_parallel_ulysses_degree
    try:
        s.check_heads(q, kv, cp, u)
    except ValueError as e:
        key = (
            "parallelism.context_parallel_ulysses_degree"
            if s.takes_ulysses_degree()
            else "parallelism.context_parallel_degree"
        )
        raise ValueError(f"{key}: the model's heads (config.json: {q} query, {kv} KV) do not split: {e}") from None


@dataclass
class HFBuilder(ModelBuilder):
    """The Hugging Face model of the folder ``path`` for :func:`~titan_cp.parallel.build.build_parallel_model`:
    CP, AC, compile and FSDP (not TP or PP); wrapped in :class:`CausalLM` after CP."""

    path: str
    args: HFModelArgs | None = None

    def meta(self) -> nn.Module:
        hf = meta_model(load_hf_config(self.path))
        self.args = HFModelArgs.of(hf)
        return hf

    def context_parallel(self, model: nn.Module, handle: CPHandle) -> nn.Module:
        apply_cp(model, handle)  # one device too
        return CausalLM(model)

    def materialize(self, model: nn.Module, device: torch.device | str, seed: int | None) -> None:
        """``to_empty``, tied weights tied again, and the buffers ``transformers`` computes at
        construction (RoPE frequencies) restored by the model's own ``_init_weights``; the weights
        themselves are loaded after (:func:`load_hf_weights`)."""
        hf = hf_model_of(model)
        ties = _ties(hf)
        model.to_empty(device=device)
        _retie(ties)
        with torch.no_grad():
            for module in hf.modules():
                if module._non_persistent_buffers_set:
                    hf._init_weights(module)


def build_parallel_hf_model(
    path: str | Path | None, parallel_dims: Any, options: Any, device: torch.device | str, fsdp: bool = True
) -> tuple[CausalLM, HFModelArgs]:
    """The HF model of folder ``path``, parallelized as the trainer's options say, this rank's shards
    allocated on ``device`` (weights not loaded yet: :func:`load_hf_weights`); and its :class:`HFModelArgs`.
    ``fsdp`` false: no FSDP whatever the mesh (generation keeps the weights whole on every cp rank)."""
    builder = HFBuilder(str(path))
    built = parallel_build.build_parallel_model(builder, parallel_dims, options, device, fsdp=fsdp)
    assert builder.args is not None, "HFBuilder.meta read the model's shapes"
    return cast(CausalLM, built.parts[0]), builder.args  # the one part HFBuilder.meta built


def check_vocab(model: CausalLM, tokenizer_vocab: int) -> None:
    """``ValueError`` when the tokenizer has ids the model's embedding has no row for."""
    rows = hf_model_of(model).get_input_embeddings().num_embeddings
    if tokenizer_vocab > rows:
        raise ValueError(
            f"model.hf_assets_path: the tokenizer has {tokenizer_vocab} ids but the model's embedding "
            f"{rows} rows (config.json vocab_size): give the tokenizer of this model"
        )


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """``(owner, name, other owner, other name)`` of every parameter registered under a second name
    (tied embeddings), read on the ``meta`` model before anything is allocated."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties: list[tuple[nn.Module, str, nn.Module, str]] = []
    for owner in model.modules():
        for name, p in owner.named_parameters(recurse=False, remove_duplicate=False):
            if id(p) in first:
                ties.append((*first[id(p)], owner, name))
            else:
                first[id(p)] = (owner, name)
    return ties


def _retie(ties) -> None:
    """Tie again what ``to_empty`` untied (a module's ``_apply`` gives each owner its own parameter
    when the storage moves off ``meta``; FSDP keeps its shared parameters shared)."""
    for owner, name, other, other_name in ties:
        if getattr(other, other_name) is not getattr(owner, name):
            setattr(other, other_name, getattr(owner, name))


def _clean(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


def _unique_state(model) -> dict:
    """``transformers``' names -> this rank's tensors (DTensor shards); a tied weight under its first name only."""
    seen, repeated = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            repeated.add(_clean(name))
        seen.add(id(p))
    return {name: t for name, t in get_model_state_dict(model).items() if name not in repeated}


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path, key: str = "checkpoint.initial_load_path") -> None:
    """Load the safetensors of the Hugging Face folder ``path`` into ``model`` (sharded on any mesh):
    each rank reads only its own slices. Every name and shape is checked first (``ValueError`` naming
    ``key``, the parameter and both shapes; nothing loaded). No collectives."""
    folder = Path(path)
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"{key} = {str(path)!r} holds no *.safetensors files (a Hugging Face model folder)")
    reader = dcp.HuggingFaceStorageReader(str(folder))
    saved = {
        k: tuple(m.size)
        for k, m in reader.read_metadata().state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    state = _unique_state(model)
    for name, t in state.items():
        if name not in saved:
            raise ValueError(f"{key} = {str(path)!r} has no {name} (a parameter of the model of model.hf_assets_path)")
        if saved[name] != tuple(t.shape):
            raise ValueError(f"{key} = {str(path)!r}: {name} has shape {saved[name]}, the model's {tuple(t.shape)}")
    extra = sorted(set(saved) - set(get_model_state_dict(model)) - {k for k in saved if k.endswith("inv_freq")})
    if extra:
        raise ValueError(f"{key} = {str(path)!r} holds parameters the model does not have, e.g. {extra[0]}")
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(folder)), no_dist=True)
    if process_rank()[0] == 0:  # once per job
        logger.info("loaded Hugging Face weights %s", folder)


@torch.no_grad()
def save_weights(
    model: nn.Module, path: str | Path, assets: str | Path | None = None, max_file_bytes: int = 5 * 2**30
) -> Path:
    """Write ``model`` (every rank's shards) as a Hugging Face folder at ``path``: safetensors and their
    index, ``config.json`` (the parameters' dtype) and the tokenizer files of ``assets``, for
    ``from_pretrained``. Collective over the default group (:func:`titan_cp.families.llama3.hf_checkpoint.write_hf_folder`)."""
    state = _unique_state(model)
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}

    def finish(folder: Path) -> None:
        config = copy.deepcopy(hf_model_of(model).config)
        config.dtype = next(iter(state.values())).dtype
        config.save_pretrained(folder)
        for f in sorted(Path(assets).iterdir()) if assets else ():
            if f.is_file() and not _WEIGHTS.search(f.name):
                shutil.copy2(f, folder / f.name)

    final = write_hf_folder(state, path, file_index(sizes, max_file_bytes), finish)
    logger.info("saved Hugging Face model %s", final)
    return final
