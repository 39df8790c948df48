"""The weights generation runs on: from the config's checkpoint, checked before any process group.

Where they come from, in order (the trainer's keys, read the same way)::

    checkpoint.enable and a step in <job.dump_folder>/<checkpoint.folder>   a titan_cp step (load_step, or the newest)
    checkpoint.initial_load_path                                          a DCP folder: titan_cp's or torchtitan's
    checkpoint.initial_load_path with checkpoint.initial_load_in_hf         a Hugging Face folder (safetensors)

Every parameter's shape is checked against the model the config builds (``model.flavor``, the
tokenizer's vocabulary) from the checkpoint's metadata alone, so a checkpoint of another
flavor is an error naming the key before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from titan_cp import checkpoint
from titan_cp.model import hf
from titan_cp.model.llama import ModelArgs, Transformer

if TYPE_CHECKING:
    from titan_cp.config import JobConfig

Kind = Literal["titan_cp", "torchtitan", "hf"]


@dataclass(frozen=True)
class WeightSource:
    """A checkpoint to load: its kind, folder, and the config key that names it (for errors)."""

    kind: Kind
    path: Path
    key: str

    @property
    def where(self) -> str:
        return f"{self.key} = {str(self.path)!r}" if self.key != "checkpoint.folder" else f"checkpoint {self.path}"


def weight_source(cfg: JobConfig) -> WeightSource:
    """The checkpoint ``cfg`` names (module docstring); ``ValueError`` when it names none."""
    c = cfg.checkpoint
    if c.enable:
        path = checkpoint.resume_path(Path(cfg.job.dump_folder) / c.folder, c.load_step)
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
        return WeightSource("hf", path, key)
    if not (path / ".metadata").is_file():
        hint = (
            "; it holds *.safetensors: set checkpoint.initial_load_in_hf = true"
            if any(path.glob("*.safetensors"))
            else ""
        )
        raise ValueError(f"{key} = {str(path)!r} is not a DCP checkpoint (no .metadata){hint}")
    metadata = checkpoint.read_metadata(path, f"{key} = {str(path)!r}", "point it at a checkpoint that is whole")
    titan_cp_keys = any(k.startswith("model.") for k in metadata.state_dict_metadata)  # torchtitan's: top level
    return WeightSource("titan_cp" if titan_cp_keys else "torchtitan", path, key)


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``args``' model (built on meta) and its shape."""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_weights(source: WeightSource, args: ModelArgs, flavor: str) -> None:
    """Every parameter of the model is in ``source`` with its shape, and ``source`` holds no other
    (the DCP metadata, or the Hugging Face headers and ``config.json``): a ``ValueError`` names the
    key, the parameter and both shapes. Reads no weight."""
    if source.kind == "hf":
        hf.check_hf_weights(source.path, args, source.key)
        return
    prefix = "model." if source.kind == "titan_cp" else ""
    metadata = checkpoint.read_metadata(source.path, source.where, "point it at a checkpoint that is whole")
    saved = {
        k[len(prefix) :]: tuple(m.size)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and hasattr(m, "size")  # tensors (not pickled bytes) under the model's names
    }
    fix = f"set model.flavor to the flavor the checkpoint was trained with (model.flavor = {flavor!r} now)"
    for name, shape in expected_shapes(args).items():
        if name not in saved:
            raise ValueError(f"{source.where} has no {name}, which model.flavor = {flavor!r} has; {fix}")
        if saved[name] != shape:
            raise ValueError(
                f"{source.where}: {name} has shape {saved[name]}, but model.flavor = {flavor!r} (vocabulary "
                f"{args.vocab_size} from the tokenizer) makes {shape}; {fix}"
            )
    extra = sorted(set(saved) - set(expected_shapes(args)))
    if source.kind == "titan_cp" and extra:
        raise ValueError(f"{source.where} holds {extra[0]}, which model.flavor = {flavor!r} does not have; {fix}")


def load_weights(source: WeightSource, model: Transformer, args: ModelArgs) -> None:
    """Load ``source`` into ``model`` (plain, or sharded by tensor parallelism), in place."""
    if source.kind == "hf":
        hf.load_hf([model], source.path, args, key=source.key)
        return
    checkpoint.Checkpointer(source.path.parent, [model], [], {}).load_model(source.path, model_only=True)
