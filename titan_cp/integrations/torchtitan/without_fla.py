"""torchtitan 0.3's Qwen3.5 imported where ``fla`` (flash-linear-attention) is not installed.

``torchtitan.models.qwen3_5.model`` imports ``fla``'s Triton kernels at import: its Gated DeltaNet's
chunked kernel and the autograd functions it registers with ``spmd_types``. titan_cp's door replaces
every call of them (:mod:`.linear`: the gated delta rule and the short convolutions run titan_cp's
linear ops, on a CPU as on a GPU), so on a machine without ``fla`` (a CPU: its kernels need a GPU) the
module is imported with stand-ins for the names it takes from ``fla`` (:func:`import_qwen35`): functions
and ``autograd.Function`` classes that raise, naming ``fla``, if anything ever calls them. The stand-in
modules leave ``sys.modules`` once torchtitan's module is imported, so nothing else sees an ``fla``
(``transformers`` picks ``fla``'s kernels for its own Qwen3.5 when ``fla`` imports). Where ``fla`` is
installed it is imported as it is; nothing is stood in.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any, NoReturn

import torch

QWEN35 = "torchtitan.models.qwen3_5"

_NAMES = {
    "fla.modules.conv.triton.ops": ("CausalConv1dFunction",),
    "fla.ops.gated_delta_rule": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "fla.ops.gated_delta_rule.chunk": ("ChunkGatedDeltaRuleFunction",),
    "fla.ops.gated_delta_rule.fused_recurrent": ("FusedRecurrentFunction",),
}
"""What ``torchtitan.models.qwen3_5.model`` imports from ``fla`` at import (torchtitan 0.3.0)."""


def _refuse(name: str) -> NoReturn:
    raise RuntimeError(
        f"fla.{name} is not installed here: torchtitan's Qwen3.5 was imported without fla "
        "(titan_cp.integrations.torchtitan runs its Gated DeltaNet through titan_cp's linear ops); "
        "run the model through titan_cp's config functions (with_titan_cp), or pip install fla-core on a GPU"
    )


def _stand_in(name: str) -> Any:
    """A function, or an ``autograd.Function`` (a class name), that raises :func:`_refuse` when called."""
    if name[0].isupper():

        class Refused(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *args: Any) -> NoReturn:
                _refuse(name)

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> NoReturn:
                _refuse(name)

        Refused.__name__ = Refused.__qualname__ = name
        return Refused

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        _refuse(name)

    refused.__name__ = refused.__qualname__ = name
    return refused


def _stand_in_modules() -> dict[str, ModuleType]:
    """The ``fla`` modules torchtitan's Qwen3.5 imports, and every package above them, with stand-ins."""
    modules: dict[str, ModuleType] = {}
    for path, names in _NAMES.items():
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            module = modules.setdefault(name, ModuleType(name, "titan_cp's stand-in: fla is not installed"))
            module.__path__ = []  # a package: its submodules import
        for name in names:
            setattr(modules[path], name, _stand_in(name))
    return modules


def fla_installed() -> bool:
    """Whether ``fla`` itself is importable here (a stand-in never is: it leaves ``sys.modules``)."""
    return importlib.util.find_spec("fla") is not None


def import_qwen35(module: str = QWEN35) -> ModuleType:
    """``module`` (torchtitan's Qwen3.5 package, or a module of it) imported: with ``fla`` where it is
    installed, else with :func:`_stand_in_modules` in ``sys.modules`` for the import only."""
    if module in sys.modules or fla_installed():
        return importlib.import_module(module)
    stand_ins = _stand_in_modules()
    assert not set(stand_ins) & set(sys.modules), "an fla module is loaded, but fla is not installed"
    sys.modules.update(stand_ins)
    try:
        return importlib.import_module(module)
    finally:
        for name in stand_ins:
            sys.modules.pop(name, None)
