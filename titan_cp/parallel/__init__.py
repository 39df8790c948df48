"""Parallelisms as small ``apply_*`` functions applied to a model from outside.

Order (as torchtitan): pipeline split, then per stage: ``apply_tp`` -> context parallel
(``apply_cp``) -> ``apply_ac`` -> ``apply_compile`` -> ``apply_fsdp``. ``apply_cp``, ``apply_ac``,
``apply_compile`` and ``apply_fsdp`` take a model of any family through its adapter
(:mod:`.adapter`); ``apply_tp`` and the pipeline split are the Llama's. :mod:`.build`: all of
them in order on a family's model (``build_parallel_model``).
"""

from titan_cp.parallel import llama  # noqa: F401 - registers the Llama's adapter (titan_cp.parallel.adapter)
from titan_cp.parallel.ac import apply_ac
from titan_cp.parallel.compile import apply_compile
from titan_cp.parallel.cp import ContextParallel, apply_cp, handle_of
from titan_cp.parallel.fsdp import apply_fsdp, set_gradient_sum
from titan_cp.parallel.pp import layers_per_stage, pipeline_llama, split_stage, stage_ids_of_rank
from titan_cp.parallel.tp import apply_tp

__all__ = [
    "ContextParallel",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "handle_of",
    "apply_fsdp",
    "apply_tp",
    "layers_per_stage",
    "pipeline_llama",
    "set_gradient_sum",
    "split_stage",
    "stage_ids_of_rank",
]
