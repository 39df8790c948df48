"""What importing titan_cp's parts pulls in, checked in one fresh interpreter (numpy blocked from its first
line), stage by stage: each stage imports more than the ones before it, so each check sees what its stage
and the earlier ones imported and nothing else.

1. ``load_config`` imports no family, model, parallel or integration code (the layers' run-time promise,
   docs/architecture.md; the static arrows are tests/test_layers.py's);
2. titan_cp, its config, its launcher and its trainer import no ``torch._dynamo`` (1.5 s at import: titan_cp
   marks its constant-result function itself, tests/test_hot_path.py; the trainer imports
   ``torch.distributed.pipelining``, which imports it, only for a pipelined run);
3. ``titan_cp.plan`` imports and plans the default (causal) mix without numpy;
4. the trainer (imported in stage 2), the testing helpers and the document helpers of the length rows load without numpy (numpy
   is not a dependency of titan_cp: only drawing mixed rows needs it).

One interpreter for the four instead of one each: starting one and importing torch is most of each check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAGES = """
import sys
sys.modules["numpy"] = None  # import numpy raises from here on

def parts():
    return {m.split(".")[1] for m in sys.modules if m.startswith("titan_cp.")}

from titan_cp.config import load_config
load_config([])
assert not {"families", "model", "parallel", "integrations"} & parts(), sorted(parts())
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
print("stages passed")
"""


def test_each_stage_imports_only_what_it_promises():
    done = subprocess.run([sys.executable, "-c", STAGES], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "recommended:" in out and "code_repo" in out, out  # the plan printed; the length rows listed
    assert out.splitlines()[-1] == "stages passed", out
