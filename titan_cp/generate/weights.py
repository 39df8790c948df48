"""The model and the weights generation runs on, from the config, checked before any process group.

The model is the one ``model.name``'s family builds (:mod:`titan_cp.families`: titan_cp's Llama of
``model.flavor``, or the Hugging Face model of ``model.hf_assets_path``), with the tokenizer's
vocabulary (:class:`~titan_cp.families.ModelSpec`). Its weights come from, in order (the trainer's keys, read the same way)::

    checkpoint.enable and a step in <job.dump_folder>/<checkpoint.folder>   a titan_cp step: checkpoint.load_step, or
                                                                          the newest (a model-only final step too)
    checkpoint.initial_load_path                                          a DCP folder: titan_cp's or torchtitan's
    checkpoint.initial_load_path with checkpoint.initial_load_in_hf         a Hugging Face folder (safetensors)

Every parameter's shape is checked against the model from the checkpoint's metadata alone, and a
checkpoint holding tensors the model does not have (e.g. Qwen3's ``q_norm`` for a Llama) is
refused, so a checkpoint of another model is an error naming the key before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_cp import checkpoint
from titan_cp.families import ModelSpec
from titan_cp.families.llama3 import torchtitan_checkpoint
from titan_cp.preflight import check_model

if TYPE_CHECKING:
    from titan_cp.config import JobConfig

Kind = Literal["titan_cp", "torchtitan", "safetensors"]  # safetensors: a Hugging Face folder
_WHOLE = "point it at a checkpoint that is whole"


def model_spec(cfg: JobConfig, vocab_size: int) -> ModelSpec:
    """The model ``cfg`` names, with the tokenizer's ``vocab_size`` (titan_cp's Llama takes it as its own)."""
    return check_model(cfg).generation_spec(cfg, vocab_size)


@dataclass(frozen=True)
class WeightSource:
    """A checkpoint to load: its kind, folder, and the config key that names it (for errors)."""

    kind: Kind
    path: Path
    key: str

    def describe(self) -> str:
        """Which weights these are, for the log: ``step N of <folder> (steps saved: [...])`` for a step."""
        if self.key != "checkpoint.folder":
            return f"{self.where} ({self.kind})"
        steps = checkpoint.saved_steps(self.path.parent)
        return f"step {self.path.name.removeprefix('step-')} of {self.path.parent} (steps saved: {steps})"

    @property
    def where(self) -> str:
        return f"{self.key} = {str(self.path)!r}" if self.key != "checkpoint.folder" else f"checkpoint {self.path}"


def weight_source(cfg: JobConfig) -> WeightSource:
    """The checkpoint ``cfg`` names (module docstring); ``ValueError`` when it names none."""
    c = cfg.checkpoint
    if c.enable:
        path = checkpoint.weights_path(Path(cfg.job.dump_folder) / c.folder, c.load_step)
        if path is not None:
            return WeightSource("titan_cp", path, "checkpoint.folder")
    if not c.initial_load_path:
        raise ValueError(
            "generation needs trained weights: set checkpoint.enable = true with the trainer's checkpoints in "
            f"job.dump_folder/checkpoint.folder ({Path(cfg.job.dump_folder) / c.folder} holds none), or "
            "checkpoint.initial_load_path (a DCP folder, or a Hugging Face folder with checkpoint.initial_load_in_hf)"
        )
    path, key = Path(c.initial_load_path), "checkpoint.initial_load_path"
    if c.initial_load_in_hf:
        return WeightSource("safetensors", path, key)
    if not (path / ".metadata").is_file():
        hint = (
            "; it holds *.safetensors: set checkpoint.initial_load_in_hf = true"
            if any(path.glob("*.safetensors"))
            else ""
        )
        raise ValueError(f"{key} = {str(path)!r} is not a DCP checkpoint (no .metadata){hint}")
    metadata = checkpoint.read_metadata(path, f"{key} = {str(path)!r}", _WHOLE)
    titan_cp_keys = any(k.startswith("model.") for k in metadata.state_dict_metadata)  # torchtitan's: top level
    return WeightSource("titan_cp" if titan_cp_keys else "torchtitan", path, key)


def _saved_shapes(source: WeightSource) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``source`` holds under the model's names (DCP metadata or safetensors headers)."""
    if source.kind == "safetensors":
        metadata = dcp.HuggingFaceStorageReader(str(source.path)).read_metadata()
        return {
            k: tuple(m.size)
            for k, m in metadata.state_dict_metadata.items()
            if not k.endswith("inv_freq") and isinstance(m, TensorStorageMetadata)
        }
    prefix = "model." if source.kind == "titan_cp" else ""
    metadata = checkpoint.read_metadata(source.path, source.where, _WHOLE)
    return {
        k[len(prefix) :]: tuple(m.size)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and hasattr(m, "size")  # tensors (not pickled bytes) under the model's names
    }


def check_weights(source: WeightSource, spec: ModelSpec) -> None:
    """Every parameter of the model is in ``source`` with its shape, and ``source`` holds no other (the
    DCP metadata, or the Hugging Face headers and ``config.json``): a ``ValueError`` names the key, the
    parameter and both shapes. Reads no weight."""
    family = spec.family
    if source.kind == "safetensors" and family.check_hf_weights(source, spec):
        return
    saved = _saved_shapes(source)
    fix = family.mismatch_fix(spec.what)
    if source.kind == "torchtitan":  # torchtitan 0.2's names or 0.3's (lm_head, qkv_linear): read as the load does
        try:
            found = torchtitan_checkpoint.sources(spec.shapes, saved, source.where)
        except ValueError as e:
            raise ValueError(f"{e} ({spec.what}, vocabulary from the tokenizer); {fix}") from None
        extra = torchtitan_checkpoint.extra_keys(saved, [s.key for s in found.values()])
        if extra:
            more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
            raise ValueError(
                f"{source.where} holds {', '.join(extra[:3])}{more}, which {spec.what} does not have; {fix}"
            )
        return
    for name, shape in spec.shapes.items():
        if name not in saved:
            raise ValueError(f"{source.where} has no {name}, which {spec.what} has; {fix}")
        if saved[name] != shape:
            raise ValueError(
                f"{source.where}: {name} has shape {saved[name]}, but {spec.what} (vocabulary from the tokenizer) "
                f"makes {shape}; {fix}"
            )
    extra = sorted(set(saved) - set(spec.shapes) - set(spec.aliases))
    if extra:
        more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
        raise ValueError(f"{source.where} holds {', '.join(extra[:3])}{more}, which {spec.what} does not have; {fix}")


def load_generation_weights(source: WeightSource, model: nn.Module, spec: ModelSpec) -> None:
    """Load ``source`` into ``model`` (plain, or sharded by tensor parallelism), in place."""
    if source.kind == "safetensors":
        spec.family.load_hf([model], source.path, spec.args, key=source.key)
    else:
        ckpt = checkpoint.Checkpointer(source.path.parent, [model], [], {}, model_what=spec.what)
        ckpt.load_model(source.path, model_only=True)
