"""``python -m titan_cp.integrations.torchtitan.train``: torchtitan 0.3's launcher
(``torchtitan.train``, the same arguments) on a CPU with gloo, for development and CI, ending as
titan_cp's commands do.

Under ``torchrun`` (``torchrun --nproc-per-node 2 -m titan_cp.integrations.torchtitan.train ...``), or
alone as one process (no ``LOCAL_RANK`` set: rank 0 of a world of 1, its store on a port of its own).
A mistake in the run's settings (the ``titan_cp`` section and its agreement with torchtitan's:
:func:`~titan_cp.integrations.torchtitan.trainer.check_run`, checked before any process group or
model) is one line naming the flag and exit status 2 (:func:`titan_cp.errors.run_cli`; under
``python -m titan_cp.run`` the launch exits 2 with nothing after it); under torchtitan's own launcher
the same message ends torchtitan's traceback. torchtitan's INFO lines come from rank 0 alone
(:func:`~titan_cp.integrations.torchtitan.reporting.log_info_on_rank0`).

On GPUs run torchtitan's own launcher, unmodified (``-m torchtitan.train``). torchtitan's Qwen3.5 imports
``fla``, whose kernels need a GPU: where ``fla`` is not installed, titan_cp's Qwen3.5 config functions import
it with stand-ins under any launcher (:mod:`.without_fla`), not here. This one adds only what torchtitan 0.3
lacks on a CPU, each scoped to this process:

1. **A "cpu" device.** ``torchtitan.tools.utils`` picks its device at import as
   ``torch._utils._get_available_device_type() or "cuda"``: with no accelerator it would ask for
   CUDA. While that module is imported here the lookup answers ``"cpu"`` (so torchtitan's device is
   ``cpu`` and its process-group backend gloo); torch's own lookup is restored right after. Its
   device module becomes ``torch.cpu`` plus what torchtitan's memory monitor asks of one
   (:class:`_CPUDeviceModule`: the name, device index 0, the host's memory as capacity, no memory
   statistics),
   before the modules that import it by name are imported.
2. **``torch.distributed.set_timeout``**, which torchtitan calls after the first step
   (``set_pg_timeouts``) and torch 2.13 does not have: given as torch's ``_set_pg_timeout``.
3. **FSDP2's sum reduction.** torchtitan turns FSDP's gradient division off (divide factor 1), and
   FSDP2 then reduce-scatters with ``PREMUL_SUM(1.0)``, which gloo does not have; forcing sum-only
   collectives (``set_force_sum_reduction_for_comms``) reduces with ``SUM`` and scales by the same
   factor 1: the same gradients.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import NoReturn

import torch
import torch._utils
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from titan_cp.errors import run_cli
from titan_cp.integrations.torchtitan.reporting import log_info_on_rank0


class _CPUDeviceModule:
    """``torch.cpu`` with what torchtitan's ``DeviceMemoryMonitor`` calls on a device module: a CPU
    keeps no allocator statistics, so none are reported (``memory_stats`` is empty)."""

    titan_cp_cpu = True  # the shims' mark (a class of this module run as __main__ is another class)

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:  # an index, as torchtitan's barrier(device_ids=[...]) takes it
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        return SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _import_torchtitan_on_cpu() -> None:
    """Shim 1: torchtitan's device is ``"cpu"`` where no accelerator is available."""
    found = torch._utils._get_available_device_type
    if found() is not None:
        return
    imported = sys.modules.get("torchtitan.tools.utils")
    if getattr(getattr(imported, "device_module", None), "titan_cp_cpu", False):
        return  # done already in this process (by this module, or by it run as __main__)
    assert "torchtitan.tools.utils" not in sys.modules, "torchtitan read its device before the CPU shim"
    torch._utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as utils  # noqa: PLC0415 - reads the device type once, at import
    finally:
        torch._utils._get_available_device_type = found
    utils.device_module = _CPUDeviceModule()


def _give_set_timeout() -> None:
    """Shim 2: ``torch.distributed.set_timeout`` where torch lacks it."""
    if not hasattr(dist, "set_timeout"):
        setattr(dist, "set_timeout", _set_pg_timeout)  # noqa: B010 - torch's stubs do not declare it


def _force_fsdp_sum_reduction() -> None:
    """Shim 3: FSDP2 modules reduce with ``SUM`` only (gloo has no ``PREMUL_SUM``)."""
    import torchtitan.distributed.fsdp as fsdp  # noqa: PLC0415

    disable_division = fsdp.disable_fsdp_gradient_division
    if getattr(disable_division, "titan_cp_cpu", False):
        return  # done already in this process

    def disable_division_sum_only(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_division_sum_only.titan_cp_cpu = True  # type: ignore[attr-defined]
    fsdp.disable_fsdp_gradient_division = disable_division_sum_only


def prepare() -> None:
    """The three shims, then torchtitan's launcher imported: what :func:`main` does before it runs it.
    A second call changes nothing (a test's launch calls it once, before it forks its runs)."""
    _import_torchtitan_on_cpu()
    _give_set_timeout()
    _force_fsdp_sum_reduction()
    import torchtitan.train  # noqa: F401, PLC0415


ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
"""What torchrun would set for one process; with ``MASTER_ADDR`` localhost and ``MASTER_PORT`` 0 (its store
binds a free port)."""


def _one_process_default() -> None:
    """Started without torchrun (no ``LOCAL_RANK``): the environment of one process alone."""
    if "LOCAL_RANK" in os.environ:
        return
    for key, value in {**ONE_PROCESS, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}.items():
        os.environ.setdefault(key, value)


def main() -> NoReturn:
    """torchtitan's ``main`` on a CPU (module docstring), under titan_cp's error path (``TITAN_CP_DEBUG=1``:
    the traceback of a user error too)."""
    _one_process_default()
    log_info_on_rank0()
    prepare()
    from torchtitan.train import main as torchtitan_main  # noqa: PLC0415

    run_cli(lambda _argv: torchtitan_main(), argv=[])  # torchtitan reads sys.argv itself


if __name__ == "__main__":
    main()
