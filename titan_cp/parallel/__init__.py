"""Parallelisms as small ``apply_*`` functions applied to a model of any family from outside.

Order (as torchtitan): pipeline split, then per stage: tensor parallel -> context parallel
(``apply_cp``) -> ``apply_ac`` -> ``apply_compile`` -> ``apply_fsdp``. ``apply_cp``, ``apply_ac``,
``apply_compile`` and ``apply_fsdp`` take a model of any family through its adapter
(:mod:`.adapter`); the tensor-parallel plan and the pipeline split are each family's, beside its model
(the Llama's: :mod:`titan_cp.families.llama3`), run by :func:`.pp.build_pipeline`. :mod:`.build`: all of
them in order on a family's model (``build_parallel_model``).
"""

from titan_cp.parallel.ac import apply_ac
from titan_cp.parallel.compile import apply_compile
from titan_cp.parallel.cp import ContextParallel, apply_cp, handle_of
from titan_cp.parallel.fsdp import apply_fsdp, set_gradient_sum
from titan_cp.parallel.pp import build_pipeline, layers_per_stage, stage_ids_of_rank

__all__ = [
    "ContextParallel",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "apply_fsdp",
    "build_pipeline",
    "handle_of",
    "layers_per_stage",
    "set_gradient_sum",
    "stage_ids_of_rank",
]
