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
   (:func:`build_parallel_model`);
3. loads the weights shard by shard (``checkpoint.initial_load_path`` with
   ``checkpoint.initial_load_in_hf``): every rank reads only its slices of the safetensors, by
   ``transformers``' own parameter names, after checking every name and shape (:func:`load_weights`);
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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from titan_cp.integrations.hf_model import check_supported, text_config
from titan_cp.integrations.hf_parallel import CausalLM, apply_ac, apply_compile, apply_fsdp, apply_tiled_mlp
from titan_cp.integrations.transformers import ATTN_IMPLEMENTATION, apply_cp

logger = logging.getLogger(__name__)

_WEIGHTS = re.compile(r"^(config\.json|model\.safetensors\.index\.json|.*\.(safetensors|bin|pt|pth))$")
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class HFModelArgs:
    """What the trainer's metrics ask of a model's shapes, read from an HF model: ``training_flops``."""

    n_layers: int
    n_heads: int
    head_dim: int
    matmul_params: int  # parameters used in matmuls: all but an untied input embedding

    @classmethod
    def of(cls, model) -> HFModelArgs:
        c = text_config(model.config)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        total = sum(p.numel() for p in model.parameters())  # a tied weight once
        lookup = 0 if head is not None and head.weight is embed.weight else embed.weight.numel()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.num_hidden_layers, c.num_attention_heads, head_dim, total - lookup)

    def training_flops(self, num_tokens: int, attention_pairs: int) -> int:
        """``6 N`` per token for the matmuls plus ``12 head_dim`` per head, layer and visible
        (query, key) pair, as ``titan_cp.model.ModelArgs.training_flops`` counts them."""
        return 6 * self.matmul_params * num_tokens + 12 * self.n_layers * self.n_heads * self.head_dim * attention_pairs


def hf_folder(path, key: str = "model.hf_assets_path") -> Path:
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


def load_config(path, key: str = "model.hf_assets_path"):
    """The ``transformers`` config of the folder ``path`` (read locally; nothing is downloaded)."""
    from transformers import AutoConfig  # noqa: PLC0415 - optional dependency

    return AutoConfig.from_pretrained(str(hf_folder(path, key)), local_files_only=True)


def meta_model(config):
    """The causal LM of ``config`` on the ``meta`` device, attention ``titan_cp``, fp32 parameters."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)


def check_job(cfg) -> None:
    """What the HF folder can tell before any process starts: ``config.json``, a supported attention,
    heads the CP strategy can split. ``ValueError`` naming the key."""
    try:
        config = load_config(cfg.model.hf_assets_path)
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


def build_parallel_model(path, parallel_dims, options, device, fsdp: bool = True) -> tuple[CausalLM, HFModelArgs]:
    """The HF model of folder ``path``, parallelized as the trainer's options say, this rank's shards
    allocated on ``device`` (weights not loaded yet: :func:`load_weights`); and its :class:`HFModelArgs`.
    ``fsdp`` false: no FSDP whatever the mesh (generation keeps the weights whole on every cp rank)."""
    from titan_cp.parallelize import cp_mesh  # noqa: PLC0415 - the trainer's module imports this one

    hf = meta_model(load_config(path))
    args = HFModelArgs.of(hf)
    mesh = cp_mesh(parallel_dims) if parallel_dims.cp_enabled else None
    apply_cp(hf, mesh, options.cp_strategy, options.cp_balance, options.cp_kernel)
    model = CausalLM(hf)
    apply_tiled_mlp(model, options.tile_tokens)
    apply_ac(model, options.ac_mode, options.ac_every, options.ac_cpu_offload, options.ac_blocks_per_checkpoint)
    if options.compile:
        apply_compile(model, backend=options.compile_backend)
    sharded = fsdp and (parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled)
    if sharded:
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            mp_param_dtype=options.mp_param_dtype,
            reshard_after_forward=options.reshard_after_forward,
            cpu_offload=options.fsdp_cpu_offload,
        )
    elif options.fsdp_cpu_offload:
        raise ValueError("training.enable_cpu_offload = true needs FSDP (a dp_shard x cp mesh larger than 1)")
    ties = _ties(hf)
    model.to_empty(device="cpu" if options.fsdp_cpu_offload else device)  # offloaded shards live on the host
    if options.fsdp_cpu_offload:
        for module in model.modules():  # buffers (RoPE frequencies) are computed on the device
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))
    _retie(ties)
    with torch.no_grad():
        for module in hf.modules():  # RoPE frequencies and other buffers computed at construction
            if module._non_persistent_buffers_set:
                hf._init_weights(module)
    return model, args


def check_vocab(model, tokenizer_vocab: int) -> None:
    """``ValueError`` when the tokenizer has ids the model's embedding has no row for."""
    rows = model.hf_model.get_input_embeddings().num_embeddings
    if tokenizer_vocab > rows:
        raise ValueError(
            f"model.hf_assets_path: the tokenizer has {tokenizer_vocab} ids but the model's embedding "
            f"{rows} rows (config.json vocab_size): give the tokenizer of this model"
        )


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """``(owner, name, other owner, other name)`` of every parameter registered under a second name
    (tied embeddings), read on the ``meta`` model before anything is allocated."""
    first, ties = {}, []
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
def load_weights(model, path, key: str = "checkpoint.initial_load_path") -> None:
    """Load the safetensors of the Hugging Face folder ``path`` into ``model`` (sharded on any mesh):
    each rank reads only its own slices. Every name and shape is checked first (``ValueError`` naming
    ``key``, the parameter and both shapes; nothing loaded). No collectives."""
    folder = Path(path)
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"{key} = {str(path)!r} holds no *.safetensors files (a Hugging Face model folder)")
    reader = dcp.HuggingFaceStorageReader(str(folder))
    saved = {k: tuple(m.size) for k, m in reader.read_metadata().state_dict_metadata.items()}
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
    logger.info("loaded Hugging Face weights %s", folder)


def _file_index(state: dict, max_file_bytes: int) -> dict[str, int]:
    """Name -> output file number (1..N): whole layers per file, each at most ``max_file_bytes``."""
    index, file, size, groups = {}, 1, 0, {}
    for name, t in state.items():
        m = _LAYER.search(name)
        groups.setdefault(m.group(1) if m else name, []).append((name, t.numel() * t.element_size()))
    for members in groups.values():
        group_bytes = sum(n for _, n in members)
        if size and size + group_bytes > max_file_bytes:
            file, size = file + 1, 0
        size += group_bytes
        index.update({name: file for name, _ in members})
    return index


@torch.no_grad()
def save_weights(model, path, assets=None, max_file_bytes: int = 5 * 2**30) -> Path:
    """Write ``model`` (every rank's shards) as a Hugging Face folder at ``path``: safetensors and their
    index, ``config.json`` (the parameters' dtype) and the tokenizer files of ``assets``, for
    ``from_pretrained``. Collective over the default group; written under ``<path>.tmp``, then renamed."""
    final, tmp = Path(path), Path(f"{path}.tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _unique_state(model)
    writer = dcp.HuggingFaceStorageWriter(
        str(tmp),
        fqn_to_index_mapping=_file_index(state, max_file_bytes),
        save_distributed=True,
        enable_consolidation=True,
    )
    dcp.save(state, storage_writer=writer)
    dist.barrier()  # rank 0 consolidated
    if rank0:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)
        config = copy.deepcopy(model.config)
        config.dtype = next(iter(state.values())).dtype
        config.save_pretrained(tmp)
        for f in sorted(Path(assets).iterdir()) if assets else ():
            if f.is_file() and not _WEIGHTS.search(f.name):
                shutil.copy2(f, tmp / f.name)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    logger.info("saved Hugging Face model %s", final)
    return final
