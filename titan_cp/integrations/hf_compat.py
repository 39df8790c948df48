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

import torch
from torch import nn

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


class TrainerHooks:
    """The private ``Trainer`` hooks the factory's mixin changes (:data:`OVERRIDDEN`), in the order of
    the class's MRO: ``(ContextParallelMixin, TrainerHooks, trainer_class)``."""

    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False, **kwargs):
        with self.cp_dataloader(is_training):
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, **kwargs)

    def _get_num_items_in_batch(self, batch_samples: list, device) -> torch.Tensor | None:
        return self.cp_num_items_in_batch(batch_samples, device)

    def _track_num_input_tokens(self, inputs) -> None:
        self.cp_track_input_tokens(inputs, super()._track_num_input_tokens)

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:
        """For a model that owns its gradient reduction (FSDP2): reduce-scatter once, after the last
        micro-batch of a step."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=self.cp_state_dict_to_save() if state_dict is None else state_dict)

    def cp_prepare_inputs(self, inputs: dict) -> dict:
        """The Trainer's own placement of a batch (device, dtype) before the model."""
        return self._prepare_inputs(inputs)


def mark_sharded(model: nn.Module) -> None:
    """Tell the Trainer that ``model`` is sharded already (FSDP2), so it leaves placement and gradient
    reduction to the model (the Trainer reads ``model.is_distributed_loading_by_transformers``)."""
    model._is_distributed_loading_by_transformers = True


@contextlib.contextmanager
def accelerate_device_mesh(accelerator, mesh) -> Iterator[None]:
    """``accelerate`` prepares dataloaders for ``mesh`` (its ``cp`` dimension reads the same rows) while
    in the block, unless it already has a mesh of its own."""
    state = accelerator.state
    before = state.device_mesh
    state.device_mesh = mesh if before is None else before
    try:
        yield
    finally:
        state.device_mesh = before
