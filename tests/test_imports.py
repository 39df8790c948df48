"""What importing titan_cp's parts pulls in and changes, checked in one fresh interpreter, stage by stage:
each stage imports more than the ones before it, so each check sees what its stage and the earlier ones
imported and nothing else. numpy is blocked from the first line to the end of stage 4.

1. ``load_config`` imports no family, model, parallel or integration code (the layers' run-time promise,
   docs/architecture.md; the static arrows are tests/test_layers.py's);
2. titan_cp, its config, its launcher and its trainer import no ``torch._dynamo`` (1.5 s at import: titan_cp
   marks its constant-result function itself, tests/test_hot_path.py; the trainer imports
   ``torch.distributed.pipelining``, which imports it, only for a pipelined run);
3. ``titan_cp.plan`` imports and plans the default (causal) mix without numpy;
4. the trainer (imported in stage 2), the testing helpers and the document helpers of the length rows load
   without numpy (numpy is not a dependency of titan_cp: only drawing mixed rows needs it);
5. where transformers is installed: importing every titan_cp module changes nothing in transformers,
   accelerate or torch. No earlier stage imported transformers or accelerate (checked), so none of their
   modules can have changed them; the registries and classes are read, every module imported, and read
   again: transformers' attention and mask registries hold the very functions they held (titan_cp adds
   its own names, ``titan_cp`` and ``titan_cp_generate``, through their public ``register``, so that
   ``attn_implementation="titan_cp"`` loads), and ``generate``, the Trainer's methods, accelerate's and
   torch's classes are untouched. Only the models ``apply_cp`` binds are guarded.

One interpreter for the five instead of one each: starting one and importing torch is most of each check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STAGES = """
import importlib, importlib.util, pkgutil, sys
sys.modules["numpy"] = None  # import numpy raises from here to the end of stage 4

def parts():
    return {m.split(".")[1] for m in sys.modules if m.startswith("titan_cp.")}

from titan_cp.config import load_config
load_config([])
assert not {"families", "parallel", "integrations"} & parts(), sorted(parts())
print("stage 1: load_config imports", sorted(parts()))

import titan_cp, titan_cp.run, titan_cp.train
assert "torch._dynamo" not in sys.modules, "titan_cp, titan_cp.config, .run or .train imported torch._dynamo"
print("stage 2: no torch._dynamo")

import titan_cp.plan as P
rc = P.main(["--ngpu", "2", "--gpu", "cpu", "--model.flavor", "debugmodel_gqa", "--training.seq_len", "1024",
             "--training.local_batch_size", "1", "--top", "1"])
assert rc == 0, rc
print("stage 3: planned")

import titan_cp.testing
from titan_cp.data.row_mixes import ROW_MIXES, lognormal_doc_lens, proportional_doc_lens
assert sum(lognormal_doc_lens(4096, 512)) == 4096 and sum(proportional_doc_lens(100, 3)) == 100
print("stage 4: row mixes", sorted(ROW_MIXES))
assert "numpy" not in {m.split(".")[0] for m, mod in sys.modules.items() if mod is not None}
print("stage 4: no numpy")

if importlib.util.find_spec("transformers") is None:
    print("stage 5: transformers is not installed")
    sys.exit(0)
assert not {"transformers", "accelerate"} & {m.split(".")[0] for m in sys.modules}, "a stage imported them"
del sys.modules["numpy"]
import accelerate, torch, transformers
from transformers import AttentionInterface, GenerationMixin, PreTrainedModel, Trainer
from transformers.masking_utils import AttentionMaskInterface

def snapshot():
    classes = (PreTrainedModel, GenerationMixin, Trainer, accelerate.Accelerator, accelerate.state.AcceleratorState, torch.nn.Module)
    return {
        "attention": dict(AttentionInterface()),
        "mask": dict(AttentionMaskInterface()),
        **{c.__qualname__: dict(vars(c)) for c in classes},
    }

before = snapshot()
names = [m.name for m in pkgutil.walk_packages(titan_cp.__path__, "titan_cp.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
assert "titan_cp.integrations.transformers" in sys.modules and len(names) > 50, names
after = snapshot()
changed = []
for what, old in before.items():
    new = after[what]
    changed += [f"{what}.{k}" for k in old if new.get(k) is not old[k]]
    own = {k for k in new if k.startswith("titan_cp")} if what in ("attention", "mask") else set()
    added = set(new) - set(old) - own
    changed += [f"{what}.{k} (added)" for k in sorted(added)]
print("stage 5: changed:", changed)
"""


@pytest.fixture(scope="module")
def stages() -> str:
    """The interpreter's output; it must exit 0."""
    done = subprocess.run([sys.executable, "-c", STAGES], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_each_stage_imports_only_what_it_promises(stages):
    assert "recommended:" in stages and "code_repo" in stages, stages  # the plan printed; the length rows listed
    assert "stage 4: no numpy" in stages.splitlines(), stages


def test_importing_every_titan_cp_module_changes_nothing_in_transformers(stages):
    pytest.importorskip("transformers", reason="transformers is in the dev extra")
    assert stages.splitlines()[-1] == "stage 5: changed: []", stages
