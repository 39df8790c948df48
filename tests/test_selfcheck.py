"""The GPU self-check's logic (``python -m titan_cp.selfcheck``; ``scripts/gpu_check.py`` adds section ``model``), run on CPU at toy sizes (``--device cpu --small``), and its
simulated ring checked for exactness against full-sequence attention."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_model import check_model
from titan_cp import selfcheck
from titan_cp.attention.kernels import get_kernel
from titan_cp.layout import SequenceLayout

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"  # the checkout's: adds section model


def test_lognormal_doc_lens_sum_to_the_row():
    lens = selfcheck.lognormal_doc_lens(131072, 1024, seed=1)
    assert sum(lens) == 131072 and min(lens) >= 1
    assert 500 < sum(lens) / len(lens) < 2000  # mean near 1024 (the last one is cut)
    assert lens == selfcheck.lognormal_doc_lens(131072, 1024, seed=1)


@pytest.mark.parametrize(
    "balance,doc_lens,window",
    [("zigzag", None, None), ("doc_zigzag", [[50, 3, 1, 74, 64, 40]], None), ("doc_local", [[90, 3, 75, 64]], 20)],
)
def test_simulated_ring_equals_full_attention(balance, doc_lens, window):
    """All ranks' ring steps in one process give full-sequence attention and its gradients (fp32),
    sliding window included."""
    s, h, kh, e, n = 232, 4, 2, 8, 4
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, h, s, e, generator=g) for _ in range(2))
    k, v = (torch.randn(1, kh, s, e, generator=g) for _ in range(2))
    layout = SequenceLayout(s, n, balance, doc_lens)
    kern = get_kernel("math", torch.device("cpu"), torch.float32)
    out, grads = selfcheck.simulated_ring(q, k, v, layout, kern, True, 0.3, dout, window)
    lens = doc_lens[0] if doc_lens else [s]
    mask = selfcheck._visible(lens, lens, True, "cpu")
    if window is not None:
        pos = torch.arange(s)
        mask &= pos[:, None] - pos[None, :] < window
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.3, enable_gqa=True)
    want = torch.autograd.grad(ref, (qs, ks, vs), dout)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


def test_small_cpu_run_passes_every_section_but_train():
    """Every default section and gpu_check.py's ``model``; ``train`` (a trainer process of its own) is
    :func:`test_selfcheck_runs_from_the_package_alone`'s."""
    records = []
    sections = [*(s for s in selfcheck.SECTIONS if s != "train"), "model"]
    summary = selfcheck.run(
        "cpu", small=True, sections=sections, emit=records.append, extra_sections={"model": check_model}
    )
    assert records[0]["section"] == "env" and "_flash_attention_forward" in records[0]["flash_attn_schemas"]
    assert records[-1] is summary and summary["status"] == "ok", summary["failures"]
    kernels = [r for r in records if r.get("section") == "kernels"]
    assert {r["kernel"] for r in kernels} == {"cpu_varlen", "cpu_flash", "math"}
    assert len(kernels) == 3 * len(selfcheck.kernel_cases(selfcheck.SMALL))
    ring = [r for r in records if r.get("section") == "ring"]
    assert [r["case"] for r in ring] == ["causal", "docs_32", "docs_32_doc_zigzag"]
    assert all(r["efficiency"]["fwd_bwd"] > 0 for r in ring)
    model = [r for r in records if r.get("section") == "model"]
    assert [r["case"] for r in model] == list(selfcheck.SMALL.model_cases)
    for r in model:  # the measured efficiency beside the counting model's, for the same shapes
        assert r["measured_efficiency"] > 0 and set(r["predicted_efficiency"]) == {"fa2_rates", "flat_60"}
        assert 0 < r["predicted_efficiency"]["flat_60"] <= r["predicted_efficiency"]["fa2_rates"]
    assert set(summary["model_efficiency"]) == set(selfcheck.SMALL.model_cases)
    linear = [r for r in records if r.get("section") == "linear"]
    assert [r["backend"] for r in linear] == ["torch"] and set(summary["linear_cut_overhead"]) == {linear[0]["case"]}
    assert {r.get("section") for r in records[1:-1]} == {"kernels", "ring", "linear", "model"}


def test_linear_section_through_fla():
    """The section's fla path (what a GPU with flash-linear-attention runs), through tests/fla_standin.py."""
    from tests import fla_standin  # noqa: PLC0415
    from titan_cp.selfcheck.linear import check_linear  # noqa: PLC0415

    with fla_standin.installed():
        (rec,) = check_linear(torch.device("cpu"), True, selfcheck.timed, 1, backend="fla")
    assert rec["backend"] == "fla" and rec["status"] == "ok", rec["errors"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed where there is no GPU")
@pytest.mark.parametrize("command", ["module", "script"])
def test_cli_without_a_gpu_says_so_and_exits_0(command, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    with pytest.raises(SystemExit) as exit_:
        if command == "module":  # python -m titan_cp.selfcheck
            runpy.run_module("titan_cp.selfcheck", run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_.value.code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and '"status": "skipped"' in out[0] and "no CUDA device" in out[0]


def test_unknown_section():
    with pytest.raises(ValueError, match="unknown selfcheck sections"):
        selfcheck.run("cpu", small=True, sections=["kernels", "nope"], emit=lambda r: None)


def _records(*statuses, meets_bar=True):
    env = {"section": "env", "device": "cpu"}
    ring = {"section": "ring", "case": "docs_1024", "status": "ok", "efficiency": {"fwd_bwd": 0.5}}
    ring["meets_bar"] = meets_bar
    return [env, ring] + [
        {"section": "kernels", "kernel": "k", "case": f"c{i}", "status": s} for i, s in enumerate(statuses)
    ]


@pytest.mark.parametrize(
    "statuses,meets_bar,want,code",
    [
        (("ok", "ok"), True, "ok", 0),
        (("ok", "ok"), False, "below_bar", 0),
        (("ok", "error"), False, "error", 1),
        (("error", "fail"), True, "fail", 1),
    ],
)
def test_summary_tells_a_missed_bar_from_an_error_and_a_failure(statuses, meets_bar, want, code):
    """A ring efficiency under its bar is reported as such, distinct from a check that could not run
    (error) and from a wrong result (fail); the command exits non-zero for the last two."""
    summary = selfcheck.summarize(_records(*statuses, meets_bar=meets_bar), torch.device("cpu"), {}, 1.0, None)
    assert summary["status"] == want and selfcheck.exit_code(summary) == code
    assert summary["ring_below_bar"] == ([] if meets_bar else ["docs_1024"])
    assert [f["status"] for f in summary["failures"]] == [s for s in statuses if s != "ok"]
    assert summary["torch"] == torch.__version__


def test_cli_exits_1_when_a_check_fails(monkeypatch, capsys):
    fail = selfcheck.summarize(_records("fail"), torch.device("cpu"), {}, 1.0, None)
    monkeypatch.setattr(selfcheck, "run", lambda *a, **k: fail)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--device", "cpu"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_.value.code == 1
    assert selfcheck.main(["--device", "cpu"]) == 1


def test_longest_search_finds_the_boundary():
    from titan_cp.selfcheck.longest import longest

    seen = []

    def fits(n):
        seen.append(n)
        return n <= 5 * 65536 + 3

    assert longest(fits, 65536, 65536, 2**24) == 5 * 65536
    assert seen[:4] == [65536, 131072, 262144, 524288]  # doubling, then bisection
    assert longest(lambda n: True, 65536, 65536, 4 * 65536) == 4 * 65536  # the cap
    assert longest(lambda n: False, 65536, 65536, 2**24) == 0
    with pytest.raises(ValueError, match="multiple of granule"):
        longest(fits, 1000, 65536, 2**24)


def test_longest_section_on_cpu():
    """Section ``longest`` at toy sizes: both configurations train up to the stand-in limit, with times."""
    records = selfcheck.longest_section(torch.device("cpu"), small=True)
    assert [r["config"] for r in records] == ["plain", "offload"]
    for r in records:
        assert r["status"] == "ok" and r["longest_seq_len"] == 512
        assert r["step_seconds_at_start"] > 0 and r["step_seconds_at_longest"] > 0
    assert records[1]["cpu_offload"] and records[1]["tile_tokens"] == 64 and not records[0]["cpu_offload"]


def test_selfcheck_runs_from_the_package_alone(tmp_path):
    """``python -m titan_cp.selfcheck`` needs nothing beside the installed package: a copy of ``titan_cp``
    alone (no train_configs/, no benchmarks/) runs the train section from an empty folder."""
    shutil.copytree(
        Path(selfcheck.__file__).parents[1], tmp_path / "titan_cp", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "-m", "titan_cp.selfcheck", "--device", "cpu", "--small", "--sections", "train"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    train = next(r for r in records if r.get("section") == "train")
    assert proc.returncode == 0 and train["status"] == "ok", train.get("error", proc.stderr[-2000:])
    assert train["steps_logged"] == 3 and train["tokens_per_second"] > 0 and train["mfu"] > 0
    assert records[-1]["summary"] and records[-1]["status"] == "ok", records[-1]
