"""Hugging Face Llama checkpoints: key names, the q/k row layout, and ``config.json``.

The same Llama has two spellings:

| titan_cp / torchtitan                  | Hugging Face ``LlamaForCausalLM``              |
|----------------------------------------|-------------------------------------------------|
| ``tok_embeddings.weight``              | ``model.embed_tokens.weight``                   |
| ``layers.N.attention.wq|wk|wv|wo``     | ``model.layers.N.self_attn.q|k|v|o_proj``       |
| ``layers.N.feed_forward.w1|w3|w2``     | ``model.layers.N.mlp.gate|up|down_proj``        |
| ``layers.N.attention_norm|ffn_norm``   | ``model.layers.N.input|post_attention_layernorm``|
| ``norm.weight`` / ``output.weight``    | ``model.norm.weight`` / ``lm_head.weight``      |

RoPE conventions. titan_cp (like torchtitan and Meta's reference code) rotates interleaved
pairs ``(x[2j], x[2j+1])``; Hugging Face rotates halves ``(x[j], x[j + E/2])``
(``rotate_half``). Both rotate by the same angle ``p * freq_j``, so the models are equal
once the rows of every q and k head are reordered. Viewing ``wq`` ``(H*E, D)`` as
``(H, E/2, 2, D)``::

    to_hf:    w_hf[h, i, j] = w[h, j, i]     (H, E/2, 2, D) -> (H, 2, E/2, D)
    from_hf:  w[h, j, i]    = w_hf[h, i, j]  (H, 2, E/2, D) -> (H, E/2, 2, D)

(``wk`` likewise with the KV head count.) This is the permutation of Hugging Face's
``convert_llama_weights_to_hf.py`` and torchtitan's ``Llama3StateDictAdapter``.

``from_hf``/``to_hf`` convert whole (unsharded) state dicts. ``load_hf``/``save_hf``
move a checkpoint folder in and out of a sharded model on any mesh with
``torch.distributed.checkpoint``'s Hugging Face storage reader and writer; each rank reads
and writes only its own shards, except q/k, which are permuted whole one layer at a time.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from titan_cp.errors import process_rank
from titan_cp.families.llama3.model import ModelArgs, RoPEScaling, Transformer
from titan_cp.files import parse_json_line, read_json

logger = logging.getLogger(__name__)

__all__ = [
    "check_hf_config",
    "check_hf_folder",
    "check_safetensors",
    "from_hf",
    "hf_config",
    "hf_key",
    "load_hf",
    "save_hf",
    "to_hf",
]

_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
}
_FROM_HF = {v: k for k, v in _TO_HF.items()}
_LAYER = re.compile(r"\.(\d+)\.")
_HF_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # old exports keep a buffer


def _rename(key: str, table: dict[str, str]) -> str | None:
    m = _LAYER.search(key)
    pattern = key if m is None else key[: m.start()] + ".{}." + key[m.end() :]
    target = table.get(pattern)
    return None if target is None else (target if m is None else target.format(m.group(1)))


def hf_key(key: str) -> str:
    """The Hugging Face name of titan_cp parameter ``key`` (``layers.0.attention.wq.weight``
    -> ``model.layers.0.self_attn.q_proj.weight``)."""
    out = _rename(key, _TO_HF)
    if out is None:
        raise KeyError(f"{key!r} has no Hugging Face Llama name")
    return out


def _permute_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs to halves: ``(H*E, D)`` -> ``(H*E, D)``."""
    return w.unflatten(0, (heads, -1, 2)).transpose(1, 2).flatten(0, 2)


def _permute_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``_permute_to_hf``."""
    return w.unflatten(0, (heads, 2, -1)).transpose(1, 2).flatten(0, 2)


def _qk_heads(key: str, args: ModelArgs) -> int | None:
    """Heads whose rows ``key`` (either spelling) holds, if it is a q or k projection."""
    if key.endswith(("attention.wq.weight", "self_attn.q_proj.weight")):
        return args.n_heads
    if key.endswith(("attention.wk.weight", "self_attn.k_proj.weight")):
        return args.kv_heads
    return None


def to_hf(state_dict: dict[str, torch.Tensor], model_args: ModelArgs) -> dict[str, torch.Tensor]:
    """titan_cp/torchtitan state dict -> Hugging Face ``LlamaForCausalLM`` state dict.

    Whole tensors (not DTensor shards); q/k rows are permuted to the rotate-half layout.
    Keys that are not Llama parameters raise ``KeyError``.
    """
    out = {}
    for key, value in state_dict.items():
        heads = _qk_heads(key, model_args)
        out[hf_key(key)] = value if heads is None else _permute_to_hf(value, heads)
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], model_args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face ``LlamaForCausalLM`` state dict -> titan_cp/torchtitan state dict.

    Whole tensors; q/k rows are permuted back to interleaved pairs; ``rotary_emb.inv_freq``
    buffers are dropped; a tied checkpoint without ``lm_head.weight`` gets ``output.weight``
    from the embedding. Other unknown keys raise ``KeyError``.
    """
    out = {}
    for key, value in hf_state_dict.items():
        if _HF_IGNORED.match(key):
            continue
        name = _rename(key, _FROM_HF)
        if name is None:
            raise KeyError(f"{key!r} is not a Hugging Face Llama parameter")
        heads = _qk_heads(key, model_args)
        out[name] = value if heads is None else _permute_from_hf(value, heads)
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ---------------------------------------------------------------------------- config.json


def hf_config(model_args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` of the ``LlamaForCausalLM`` equal to ``model_args`` (read by transformers
    4.x, which takes ``rope_theta``/``rope_scaling``, and 5.x, which converts them)."""
    a = model_args
    s = a.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_hidden_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "vocab_size": a.vocab_size,
        "max_position_embeddings": a.max_seq_len,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": None
        if s is None
        else {
            "rope_type": "llama3",
            "factor": s.scaling_factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _rope_of(config: dict) -> tuple[float, RoPEScaling | None, str]:
    """(theta, scaling, rope_type) from a 4.x (``rope_theta``, ``rope_scaling``) or 5.x
    (``rope_parameters``) config."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "llama3":
        return theta, None, kind
    scaling = RoPEScaling(
        scaling_factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
    return theta, scaling, kind


def check_hf_config(config: dict, model_args: ModelArgs, where: str = "config.json") -> None:
    """Raise ``ValueError`` naming the first field of a Hugging Face ``config`` that makes a model
    other than ``model_args``: what the weights' shapes cannot show (head counts, RoPE, norm eps,
    activation, biases)."""
    a = model_args
    theta, scaling, kind = _rope_of(config)
    heads = config.get("num_attention_heads", a.n_heads)
    checks = [
        ("hidden_size", config.get("hidden_size", a.dim), a.dim),
        ("num_hidden_layers", config.get("num_hidden_layers", a.n_layers), a.n_layers),
        ("num_attention_heads", heads, a.n_heads),
        ("num_key_value_heads", config.get("num_key_value_heads") or heads, a.kv_heads),
        ("head_dim", config.get("head_dim") or a.dim // max(heads, 1), a.head_dim),
        ("intermediate_size", config.get("intermediate_size", a.ffn_hidden_dim), a.ffn_hidden_dim),
        ("vocab_size", config.get("vocab_size", a.vocab_size), a.vocab_size),
        ("rms_norm_eps", config.get("rms_norm_eps", a.norm_eps), a.norm_eps),
        ("hidden_act", config.get("hidden_act", "silu"), "silu"),
        ("attention_bias", config.get("attention_bias", False), False),
        ("mlp_bias", config.get("mlp_bias", False), False),
        ("rope_theta", theta, a.rope_theta),
        ("rope_type", kind, "default" if a.rope_scaling is None else "llama3"),
        ("rope_scaling", scaling, a.rope_scaling),
    ]
    for name, theirs, ours in checks:
        if isinstance(ours, float) and isinstance(theirs, (int, float)):
            same = abs(theirs - ours) <= 1e-9 * abs(ours)
        else:
            same = theirs == ours
        if not same:
            raise ValueError(
                f"{where}: {name} = {theirs!r}, but the model (model.flavor with its overrides) has {ours!r}; "
                "choose the flavor that matches the checkpoint"
            )


# ---------------------------------------------------------------------------- in and out of a sharded model


def _expected_shapes(model_args: ModelArgs) -> dict[str, torch.Size]:
    """Every parameter of the whole model (all pipeline stages) and its global shape."""
    with torch.device("meta"):
        model = Transformer(model_args)
    return {name: p.shape for name, p in model.named_parameters()}


def check_safetensors(file: Path, where: str) -> None:
    """The ``.safetensors`` file ``file`` is whole: an 8-byte header length, a JSON header of that
    length, and every tensor's ``data_offsets`` within the file. Reads the header only; a
    ``ValueError`` prefixed by ``where`` names the file and what is wrong."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ValueError(f"{where}: {file} is truncated or not a .safetensors file ({size} bytes, no whole header)")
        header = parse_json_line(f.read(n), f"{where}: {file} header")
    if not isinstance(header, dict):
        raise ValueError(f"{where}: {file} is not a .safetensors file (its header is not a JSON object)")
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ValueError(f"{where}: {file} is not a .safetensors file (a tensor without data_offsets)") from None
    if 8 + n + end > size:
        raise ValueError(f"{where}: {file} is truncated ({size} bytes; its tensors end at byte {8 + n + end})")


def _hf_folder(path: str | Path, key: str) -> Path:
    """The Hugging Face checkpoint folder of ``key = path``, checked: it holds ``*.safetensors``
    files, whole, and every file its index names; its JSON files are JSON."""
    folder = Path(path)
    where = f"{key} = {str(path)!r}"
    if not folder.exists():
        raise ValueError(f"{where}: no such file or directory")
    if not folder.is_dir():
        raise ValueError(f"{where} is a file; give the folder that holds the *.safetensors files")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{where} holds no *.safetensors files (a Hugging Face checkpoint folder)")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, f"{where}: {index}")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{where}: {index} has no weight_map object")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ValueError(f"{where}: {index.name} names files that are missing: {missing}")
    for file in sorted(folder.glob("*.safetensors")):
        check_safetensors(file, where)
    _read_config(folder, where)
    return folder


def _read_config(folder: Path, where: str) -> dict:
    """``config.json`` of ``folder`` as a dict; empty when there is none."""
    path = folder / "config.json"
    if not path.is_file():
        return {}
    config = read_json(path, f"{where}: {path}")
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {path} must hold a JSON object, got {type(config).__name__}")
    return config


def _plan(folder: Path, model_args: ModelArgs, key: str) -> dict[str, str]:
    """titan_cp name -> Hugging Face name to read it from, after checking every shape (and
    ``config.json`` where there is one); raises ``ValueError`` before anything is loaded."""
    hf_shapes = {}
    for k, m in dcp.HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata.items():
        if _HF_IGNORED.match(k):
            continue
        if not isinstance(m, TensorStorageMetadata):
            raise ValueError(f"{key} = {str(folder)!r}: {k!r} in its safetensors is not a tensor")
        hf_shapes[k] = m.size
    config = _read_config(folder, f"{key} = {str(folder)!r}")
    plan = {}
    for name, shape in _expected_shapes(model_args).items():
        source = hf_key(name)
        if source not in hf_shapes and name == "output.weight" and config.get("tie_word_embeddings", False):
            source = hf_key("tok_embeddings.weight")  # tied checkpoint: the output is the embedding
        if source not in hf_shapes:
            raise ValueError(f"{key} = {str(folder)!r} has no {source} (the model's {name})")
        if tuple(hf_shapes[source]) != tuple(shape):
            raise ValueError(
                f"{key} = {str(folder)!r}: {source} has shape {tuple(hf_shapes[source])}, but the model's "
                f"{name} has shape {tuple(shape)} (model.flavor and the tokenizer's vocabulary set the shapes)"
            )
        plan[name] = source
    extra = sorted(set(hf_shapes) - set(plan.values()))
    if extra:
        raise ValueError(f"{key} = {str(folder)!r} holds parameters the model does not have, e.g. {extra[0]}")
    if config:
        check_hf_config(config, model_args, where=f"{key} = {str(folder)!r}: config.json")
    else:
        logger.warning("%s: no config.json; only the weights' shapes were checked against the flavor", folder)
    return plan


def _local_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The part of the whole tensor ``full`` that this rank holds of ``like``'s placements."""
    shape, offset = _local_shape_and_offset(like)
    return full[tuple(slice(o, o + n) for n, o in zip(shape, offset))]


def _local_shape_and_offset(t: DTensor):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)


def _model_state(model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Clean parameter names (no wrapper prefixes) -> the parameters (sharing storage) of every part."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: dict[str, torch.Tensor] = {}
    for part in model_parts:
        # a model's state dict holds tensors; the stub's value type is the one shared with optimizer state
        state.update(cast(dict[str, torch.Tensor], get_model_state_dict(part)))
    return state


def check_hf_folder(path: str | Path, key: str = "checkpoint.initial_load_path") -> None:
    """What :func:`load_hf` checks of the folder before reading any weight, from the files alone
    (no model, no process group): ``*.safetensors`` present and whole, the index's files present,
    ``config.json`` and the index JSON. A ``ValueError`` names ``key``, the file and the fault."""
    _hf_folder(path, key)


def check_hf_weights(path: str | Path, model_args: ModelArgs, key: str = "checkpoint.initial_load_path") -> None:
    """:func:`check_hf_folder`, and every weight's shape (and ``config.json``) against ``model_args``,
    as :func:`load_hf` checks them first: from the headers alone, no process group."""
    _plan(_hf_folder(path, key), model_args, key)


@torch.no_grad()
def load_hf(
    model_parts: Sequence[nn.Module], path: str | Path, model_args: ModelArgs, key: str = "checkpoint.initial_load_path"
) -> None:
    """Load the Hugging Face Llama checkpoint folder ``path`` (``*.safetensors``, one file or
    several with ``model.safetensors.index.json``) into ``model_parts``, in place, whatever
    their sharding (FSDP, TP, CP, pipeline stages).

    Every shape (and ``config.json``, where present) is checked against ``model_args`` first:
    a ``ValueError`` names ``key``, the first mismatching parameter and both shapes, and
    nothing is loaded. Each rank reads only the slices it holds, except q/k (whole, one layer
    at a time, to undo the rotate-half permutation). No collectives: ranks may hold different
    pipeline stages.
    """
    folder = _hf_folder(path, key)
    plan = _plan(folder, model_args, key)
    state = _model_state(model_parts)
    direct = {plan[name]: t for name, t in state.items() if _qk_heads(name, model_args) is None}
    dcp.load(direct, storage_reader=dcp.HuggingFaceStorageReader(str(folder)), no_dist=True)
    for layer in range(model_args.n_layers):
        names = [
            n for n in (f"layers.{layer}.attention.wq.weight", f"layers.{layer}.attention.wk.weight") if n in state
        ]
        if not names:
            continue  # another pipeline stage's layer
        full = {plan[n]: torch.empty(state[n].shape, dtype=state[n].dtype, device=state[n].device) for n in names}
        dcp.load(full, storage_reader=dcp.HuggingFaceStorageReader(str(folder)), no_dist=True)
        for n in names:
            heads = _qk_heads(n, model_args)
            if heads is None:
                raise RuntimeError(f"{n} is not a q or k projection")
            w = _permute_from_hf(full[plan[n]], heads)
            target = state[n]
            if isinstance(target, DTensor):
                target.to_local().copy_(_local_slice(w, target))
            else:
                target.copy_(w)
    if process_rank()[0] == 0:  # once per job
        logger.info("loaded Hugging Face checkpoint %s", folder)


def file_index(sizes: dict[str, int], max_file_bytes: int) -> dict[str, int]:
    """Hugging Face name -> output file number (1..N) for tensors of ``sizes`` (name -> bytes, in
    order): whole layers per file, each file at most ``max_file_bytes`` unless one layer is larger."""
    index, file, size = {}, 1, 0
    groups: dict[str, list[tuple[str, int]]] = {}
    for name, nbytes in sizes.items():
        m = _LAYER.search(name)
        groups.setdefault(m.group(1) if m else name, []).append((name, nbytes))
    for members in groups.values():
        group_bytes = sum(n for _, n in members)
        if size and size + group_bytes > max_file_bytes:
            file, size = file + 1, 0
        size += group_bytes
        index.update({k: file for k, _ in members})
    return index


def write_hf_folder(
    state: dict[str, torch.Tensor], path: str | Path, index: dict[str, int], finish: Callable[[Path], None]
) -> Path:
    """The one distributed safetensors writer: ``state`` (Hugging Face name -> this rank's tensor,
    a DTensor shard or whole) written to ``path`` as ``model-0000i-of-0000N.safetensors`` per ``index``
    (:func:`file_index`) and their ``model.safetensors.index.json``; then rank 0 calls ``finish(folder)``
    to add ``config.json`` and any other file. Each rank writes its own shards
    (``HuggingFaceStorageWriter(save_distributed=True)``), rank 0 consolidates them into whole
    tensors. Collective over the default group; written under ``<path>.tmp``, renamed when complete."""
    final, tmp = Path(path), Path(f"{path}.tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    writer = dcp.HuggingFaceStorageWriter(
        str(tmp), fqn_to_index_mapping=index, save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer)
    dist.barrier()  # rank 0 consolidated
    if rank0:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)
        finish(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    return final


@torch.no_grad()
def save_hf(
    model_parts: Sequence[nn.Module], path: str | Path, model_args: ModelArgs, max_file_bytes: int = 5 * 2**30
) -> Path:
    """Write ``model_parts`` (every rank's shards together) as a Hugging Face Llama checkpoint
    folder: ``model-0000i-of-0000N.safetensors``, ``model.safetensors.index.json`` and
    ``config.json``, readable by ``LlamaForCausalLM.from_pretrained``. Collective over the
    default process group (:func:`write_hf_folder`); q/k are gathered one layer at a time,
    permuted to the rotate-half layout and re-sharded before the write. The file index comes
    from the whole model's shapes, so every pipeline stage writes to the same files.
    """
    state = _model_state(model_parts)
    out = {}
    for name, t in state.items():
        heads = _qk_heads(name, model_args)
        if heads is None:
            out[hf_key(name)] = t
        elif isinstance(t, DTensor):
            w = _permute_to_hf(t.full_tensor(), heads)
            out[hf_key(name)] = DTensor.from_local(
                _local_slice(w, t).clone(), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
            )
        else:
            out[hf_key(name)] = _permute_to_hf(t, heads).contiguous()
    dtype = next(iter(state.values())).dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {hf_key(name): shape.numel() * itemsize for name, shape in _expected_shapes(model_args).items()}

    def finish(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(hf_config(model_args, dtype), indent=2) + "\n")

    final = write_hf_folder(out, path, file_index(sizes, max_file_bytes), finish)
    logger.info("saved Hugging Face checkpoint %s", final)
    return final
