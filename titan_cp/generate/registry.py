"""How each model family builds and runs its models for generation, registered by the family's name
(``model.name``) as the parallel adapters are (:func:`titan_cp.parallel.adapter.register_adapter`):
titan_cp's Llama (:mod:`.runners`) and Hugging Face causal LMs (:mod:`.hf_runner`, which imports
``transformers``: loaded when such a model is built or run). A built model's family is its
adapter's (:func:`titan_cp.families.family_of`); a third family is one :func:`register_generation` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from titan_cp.families import LLAMA3, ModelSpec, family_of
from titan_cp.families.llama3.model import Transformer
from titan_cp.generate.runners import LlamaRunner, Runner, build_generation_model
from titan_cp.integrations.hf_family import HF
from titan_cp.mesh import ParallelDims

BuildForGeneration = Callable[[ModelSpec, "ParallelDims | None", str, str, "torch.device | str"], nn.Module]
"""``(spec, dims, strategy, balance, device)`` -> the model of ``spec`` parallelized for generation over
``dims``' mesh (``None``: one device), shards allocated for the weights to be loaded."""


@dataclass(frozen=True)
class Generation:
    """How one model family's models are built (``build``) and run (``runner``) for generation."""

    build: BuildForGeneration
    runner: Callable[[nn.Module], Runner]


_BY_FAMILY: dict[str, Generation] = {}


def register_generation(family: str, build: BuildForGeneration, runner: Callable[[nn.Module], Runner]) -> None:
    """Make generation build and run the models of the family called ``family`` (``model.name``)."""
    _BY_FAMILY[family] = Generation(build, runner)


def generation_of(family: str) -> Generation:
    """How the family called ``family`` generates; ``ValueError`` naming the fix for one without."""
    if family not in _BY_FAMILY:
        raise ValueError(
            f"model.name = {family!r}: titan_cp.generate has no runner for this family; register one with "
            "titan_cp.generate.registry.register_generation"
        )
    return _BY_FAMILY[family]


def build_for_generation(
    spec: ModelSpec, dims: ParallelDims | None, strategy: str, balance: str, device: torch.device | str
) -> nn.Module:
    """``spec``'s model parallelized for generation over ``dims``' mesh, shards allocated (weights to load)."""
    return generation_of(spec.family.name).build(spec, dims, strategy, balance, device)


def runner_of(model: nn.Module) -> Runner:
    """Generation's runner of the built ``model``, by its family (:func:`titan_cp.families.family_of`)."""
    return generation_of(family_of(model).name).runner(model)


def _build_llama(
    spec: ModelSpec, dims: ParallelDims | None, strategy: str, balance: str, device: torch.device | str
) -> nn.Module:
    return build_generation_model(spec.args, dims, strategy, balance, device)


def _build_hf(
    spec: ModelSpec, dims: ParallelDims | None, strategy: str, balance: str, device: torch.device | str
) -> nn.Module:
    from titan_cp.generate.hf_runner import build_hf_model  # noqa: PLC0415 - transformers is optional

    assert spec.folder is not None, "a Hugging Face model's spec names its folder"
    return build_hf_model(spec.folder, dims, strategy, balance, device)


def _hf_runner(model: nn.Module) -> Runner:
    from titan_cp.generate.hf_runner import HFRunner  # noqa: PLC0415 - transformers is optional

    return HFRunner(model)


def _llama_runner(model: nn.Module) -> Runner:
    return LlamaRunner(cast(Transformer, model))  # family_of(model) is the Llama's


register_generation(LLAMA3.name, _build_llama, _llama_runner)
register_generation(HF.name, _build_hf, _hf_runner)
