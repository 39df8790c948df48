"""The Trainer factory's reliance on ``transformers``' and ``accelerate``'s private parts
(``titan_cp.integrations.hf_compat``), checked against the versions it pins: an upgrade that renames
or reshapes one of them fails here, by name."""

from __future__ import annotations

import inspect

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
accelerate = pytest.importorskip("accelerate", reason="accelerate is in the dev extra")

from titan_cp.integrations import hf_compat, trainer_factory  # noqa: E402
from titan_cp.integrations.hf_compat import CALLED, OVERRIDDEN, PINNED, TrainerHooks  # noqa: E402
from titan_cp.integrations.trainer_factory import CPOptions, context_parallel_trainer  # noqa: E402


def test_the_installed_versions_are_the_pinned_ones():
    for package in (transformers, accelerate):
        assert package.__version__.startswith(PINNED[package.__name__] + "."), (
            f"{package.__name__} {package.__version__} is installed but titan_cp.integrations.hf_compat is written "
            f"for {PINNED[package.__name__]}: check every private hook it names, then update PINNED"
        )


def test_every_private_hook_exists_with_the_parameters_it_expects_and_the_trainer_calls_it():
    trainer_source = inspect.getsource(transformers.trainer)
    for name, params in {**OVERRIDDEN, **CALLED}.items():
        hook = getattr(transformers.Trainer, name)
        assert tuple(inspect.signature(hook).parameters)[1:] == params, name
        assert f"self.{name}" in trainer_source, f"transformers.Trainer no longer calls {name}"
    hf_compat.check_trainer_hooks(transformers.Trainer)  # what the factory checks at run time
    # the model's flag the Trainer reads to leave an FSDP-sharded model's placement alone
    assert transformers.PreTrainedModel._is_distributed_loading_by_transformers is False
    assert 'getattr(model, "is_distributed_loading_by_transformers"' in trainer_source
    # accelerate's dataloader preparation reads the state's mesh
    assert "self.device_mesh = None" in inspect.getsource(accelerate.state.AcceleratorState.__init__)
    assert "torch_device_mesh" in inspect.signature(accelerate.data_loader.prepare_data_loader).parameters
    assert "self.state.device_mesh" in inspect.getsource(accelerate.Accelerator)


def test_private_trainer_hooks_are_overridden_in_hf_compat_only():
    own = {n for n in vars(TrainerHooks) if n.startswith("_") and not n.startswith("__")}
    assert own == set(OVERRIDDEN)
    elsewhere = [
        f"{c.__name__}.{n}"
        for c in trainer_factory.ContextParallelMixin.__mro__
        if c is not TrainerHooks and c.__module__.startswith("titan_cp")
        for n in vars(c)
        if n.startswith("_") and not n.startswith("__") and hasattr(transformers.Trainer, n)
    ]
    assert elsewhere == []


def test_a_trainer_whose_private_hooks_changed_is_refused_by_name():
    class Reshaped(transformers.Trainer):
        def _get_num_items_in_batch(self, batch_samples, device, dp_group):
            return None

    class Renamed(transformers.Trainer):
        _track_num_input_tokens = None

    with pytest.raises(
        ValueError,
        match=r"relies on Reshaped._get_num_items_in_batch\(batch_samples, device\), a private hook of transformers "
        r"5.24; transformers .* has _get_num_items_in_batch\(batch_samples, device, dp_group\)",
    ):
        context_parallel_trainer(Reshaped, cp_size=2)
    with pytest.raises(ValueError, match=r"Renamed._track_num_input_tokens\(inputs\), .* has no such method"):
        context_parallel_trainer(Renamed, cp_size=2)


def test_options_are_keywords_only():
    with pytest.raises(TypeError):
        CPOptions(2)
    with pytest.raises(TypeError):
        context_parallel_trainer(transformers.Trainer, 2)
    options = context_parallel_trainer(transformers.Trainer, cp_size=2, strategy="ulysses").cp_options
    assert options == CPOptions(cp_size=2, strategy="ulysses")
