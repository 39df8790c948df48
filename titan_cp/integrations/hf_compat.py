"""What the Trainer factory (:mod:`.trainer_factory`) needs of ``transformers``' and ``accelerate``'s
private parts, in one place, against the versions it is written for (:data:`PINNED`).

The factory's subclass changes five private ``Trainer`` hooks (:class:`TrainerHooks`, each a thin
override that calls a ``cp_*`` method of the factory's mixin), calls one private method
(``_prepare_inputs``), marks an FSDP-sharded model by a private attribute (:func:`mark_sharded`) and
lends ``accelerate``'s dataloader preparation a mesh (:func:`accelerate_device_mesh`). None of them is
public API: a release may rename one, and an override of a hook the Trainer no longer calls would
be silently dead (the loss scaled wrong, tokens miscounted). So :func:`check_trainer_hooks` refuses
a Trainer class whose hooks are not the ones named here, and ``tests/test_hf_compat.py`` checks the
installed versions against :data:`PINNED`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # the hooks are mixed into a Trainer subclass; to the type checker they extend Trainer itself
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.data import DataLoader, Dataset, Sampler
    from transformers import Trainer as _TrainerHost
else:
    _TrainerHost = object

PINNED = {"transformers": "5.24", "accelerate": "1.16"}  # major.minor this module is written and tested for

# Every private Trainer method the factory overrides or calls -> its parameters (after self) in PINNED.
OVERRIDDEN = {
    "_get_dataloader": ("dataset", "description", "batch_size", "sampler_fn", "is_training", "dataloader_key"),
    "_get_num_items_in_batch": ("batch_samples", "device"),
    "_track_num_input_tokens": ("inputs",),
    "_defer_fsdp_gradient_reduction": (),
    "_save": ("output_dir", "state_dict"),
}
CALLED = {"_prepare_inputs": ("inputs",)}
_SHARDED = "_is_distributed_loading_by_transformers"  # the Trainer's mark of a model sharded already


def _parameters(fn: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)[1:]


def check_trainer_hooks(trainer_class: type) -> None:
    """``ValueError`` unless ``trainer_class`` has every private method of :data:`OVERRIDDEN` and
    :data:`CALLED` with the parameters named there (as in the versions of :data:`PINNED`)."""
    import transformers  # noqa: PLC0415 - optional dependency

    for name, want in {**OVERRIDDEN, **CALLED}.items():
        fn = getattr(trainer_class, name, None)
        got = _parameters(fn) if callable(fn) else None
        if got != want:
            found = "no such method" if got is None else f"{name}({', '.join(got)})"
            raise ValueError(
                f"context_parallel_trainer relies on {trainer_class.__name__}.{name}({', '.join(want)}), a private "
                f"hook of transformers {PINNED['transformers']}; transformers {transformers.__version__} has {found}: "
                f"install transformers {PINNED['transformers']}.x or update titan_cp.integrations.hf_compat"
            )


class TrainerHooks(_TrainerHost):
    """The private ``Trainer`` hooks the factory's mixin changes (:data:`OVERRIDDEN`), in the order of
    the class's MRO: ``(ContextParallelMixin, TrainerHooks, trainer_class)``. At run time its base is
    ``object``; to the type checker it is ``transformers.Trainer``, the host the class is mixed into."""

    if TYPE_CHECKING:  # the mixin's (first in the MRO), which these hooks call

        def cp_dataloader(self, training: bool) -> contextlib.AbstractContextManager[None]: ...
        def cp_num_items_in_batch(self, batch_samples: list, device: torch.device | None) -> torch.Tensor | None: ...
        def cp_track_input_tokens(self, inputs: dict[str, Any], track: Callable[[dict[str, Any]], None]) -> None: ...
        def cp_state_dict_to_save(self) -> dict | None: ...

    def _get_dataloader(
        self,
        dataset: Dataset,
        description: str,
        batch_size: int,
        sampler_fn: Callable[[Dataset], Sampler] | None = None,
        is_training: bool = False,
        dataloader_key: str | None = None,
    ) -> DataLoader:
        with self.cp_dataloader(is_training):
            return super()._get_dataloader(
                dataset, description, batch_size, sampler_fn, is_training, dataloader_key=dataloader_key
            )

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device | None) -> torch.Tensor | None:
        return self.cp_num_items_in_batch(batch_samples, device)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        self.cp_track_input_tokens(inputs, super()._track_num_input_tokens)

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:
        """For a model that owns its gradient reduction (FSDP2): reduce-scatter once, after the last
        micro-batch of a step."""
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

        model = self.model
        assert isinstance(model, FSDPModule), "the Trainer defers the reduction of FSDP-managed models only"
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=self.cp_state_dict_to_save() if state_dict is None else state_dict)

    def cp_prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The Trainer's own placement of a batch (device, dtype) before the model."""
        return self._prepare_inputs(inputs)


def mark_sharded(model: nn.Module) -> None:
    """Tell the Trainer that ``model`` is sharded already (FSDP2), so it leaves placement and gradient
    reduction to the model (the Trainer reads ``model.is_distributed_loading_by_transformers``)."""
    setattr(model, _SHARDED, True)


@contextlib.contextmanager
def accelerate_device_mesh(accelerator: Any, mesh: DeviceMesh | None) -> Iterator[None]:
    """``accelerate`` prepares dataloaders for ``mesh`` (its ``cp`` dimension reads the same rows) while
    in the block, unless it already has a mesh of its own."""
    state = accelerator.state
    before = state.device_mesh
    state.device_mesh = mesh if before is None else before
    try:
        yield
    finally:
        state.device_mesh = before
