"""The planner prints only what the trainer runs, on whole nodes, at any scale.

- Every plan printed for the repository's configs at 1 to 1,024 GPUs passes the trainer's own checks: each
  JSON line's ``overrides`` and the recommended plan's ``torchrun`` line, loaded as the trainer loads its
  command line (``load_config``, the family's keys, the mesh, the batch sizes).
- Without ``--nnodes`` the GPUs fill whole nodes of the device (8 GPUs): 1,024 H100s are 128 nodes of 8.
- At 65,536 GPUs an answer comes from a few estimates (the rest bounded out, counted), with no layout counted
  pair of ranks by pair; a search that would need that says in one line what to narrow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_cp.config import load_config
from titan_cp.errors import run_cli
from titan_cp.plan import main, plan
from titan_cp.preflight import check_model

CONFIGS = sorted(str(p) for p in Path("train_configs").glob("*.toml"))
QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, tie_word_embeddings=True, sliding_window=None, use_sliding_window=False,
)  # fmt: skip


def _flags(keys: dict) -> list[str]:
    return [x for k, v in keys.items() for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def _trainer_takes(argv: list[str], ngpu: int) -> None:
    """What ``python -m titan_cp.train`` checks of ``argv`` before its first step on ``ngpu`` ranks."""
    cfg = load_config(argv, warn_adjustments=False)
    check_model(cfg)
    dims = cfg.parallel_dims(ngpu)
    cfg.resolve_batch_sizes(dims.dp_replicate * dims.dp_shard)


def _printed(capsys, argv: list[str]) -> tuple[list[dict], list[str]] | None:
    """The JSON lines and the ``torchrun`` lines the planner prints for ``argv``; ``None`` when it refuses."""
    try:
        main(argv)
    except ValueError:
        capsys.readouterr()
        return None
    out = capsys.readouterr().out.splitlines()
    return [json.loads(line) for line in out if line.startswith("{")], [x for x in out if x.startswith("torchrun")]


@pytest.mark.parametrize("config", [*CONFIGS, "train_configs/hf/qwen3_cp.toml"])
def test_every_printed_plan_passes_the_trainers_checks(capsys, tmp_path, config):
    extra = []
    if "/hf/" in config:
        (tmp_path / "config.json").write_text(json.dumps(QWEN3))
        extra = ["--model.hf_assets_path", str(tmp_path), "--checkpoint.initial_load_path", str(tmp_path)]
    planned = 0
    for ngpu in (1, 4, 8, 64, 1024):
        printed = _printed(capsys, ["--job.config_file", config, *extra, "--ngpu", str(ngpu)])
        if printed is None:  # the config's own degrees do not lay out on ngpu
            continue
        records, launches = printed
        assert records and launches
        for r in records:
            _trainer_takes(["--job.config_file", config, *extra, *_flags(r["overrides"])], ngpu)
        command = launches[0].split(" -m titan_cp.train ")[1].split()
        _trainer_takes([*command[:2], *extra, *command[2:]], ngpu)
        planned += len(records)
    assert planned >= 5, config


def test_the_debug_config_on_4_gpus_plans_the_batch_it_has(capsys):
    """debug_cp.toml's global batch is 2 rows of 1: at most 2 data-parallel ranks, never FSDP 4."""
    records, launches = _printed(capsys, ["--job.config_file", "train_configs/debug_cp.toml", "--ngpu", "4"])
    assert records and all(r["dp_shard"] * r["dp_replicate"] <= 2 for r in records)
    assert "--parallelism.data_parallel_shard_degree 4" not in launches[0]


def test_gpus_fill_whole_nodes_unless_nnodes_says_otherwise(capsys):
    argv = ["--model.flavor", "8B", "--training.seq_len", "131072", "--training.local_batch_size", "1"]
    _, launches = _printed(capsys, [*argv, "--ngpu", "1024"])
    assert launches[0].startswith("torchrun --nnodes 128 --nproc-per-node 8 ")
    _, launches = _printed(capsys, [*argv, "--ngpu", "4"])
    assert launches[0].startswith("torchrun --standalone --nproc-per-node 4 ")
    _, launches = _printed(capsys, [*argv, "--ngpu", "64", "--nnodes", "4"])
    assert launches[0].startswith("torchrun --nnodes 4 --nproc-per-node 16 ")
    with pytest.raises(SystemExit) as exit_:
        run_cli(main, [*argv, "--ngpu", "12"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--ngpu 12 is not a whole number of 8-GPU h100 nodes: give --nnodes" in err


def test_65536_gpus_answer_from_a_few_estimates(monkeypatch):
    """8B at 65,536 GPUs: every plan's memory and bound in closed form; a handful estimated, the rest bounded
    out, and no layout counted pair of ranks by pair (a few pairs' tiles for the closed forms, no assignment
    tried)."""
    from titan_cp import doc_local  # noqa: PLC0415
    from titan_cp.attention import tiling  # noqa: PLC0415
    from titan_cp.plan import search  # noqa: PLC0415

    calls, tiles, tried = [], [], []
    evaluate, tiles_of_runs, choose = search.evaluate, tiling.tiles_of_runs, doc_local._choose
    monkeypatch.setattr(search, "evaluate", lambda c, *a: calls.append(c) or evaluate(c, *a))
    monkeypatch.setattr(tiling, "tiles_of_runs", lambda *a: tiles.append(1) or tiles_of_runs(*a))
    monkeypatch.setattr(doc_local, "_choose", lambda lens, n: tried.append(n) or choose(lens, n))
    result = plan(load_config(["--model.flavor", "8B"]), 65536)
    assert result.context.nnodes == 8192 and result.recommended
    assert len(calls) == len(result.estimates) <= 8
    assert result.skipped.bounded > 500 and result.skipped.refused > 0
    long = plan(load_config(["--job.config_file", "train_configs/llama3_8b_128k.toml"]), 65536)
    assert long.best.candidate.cp >= 1024 and len(long.estimates) <= 8
    assert len(tiles) <= 16 and set(tried) <= {1}, (len(tiles), tried)  # one rank: nothing to try


def test_a_search_past_what_can_be_counted_says_what_to_narrow(capsys):
    pytest.importorskip("numpy")  # the document mixes but causal draw with numpy
    argv = ["--job.config_file", "train_configs/llama3_8b_128k.toml", "--ngpu", "65536", "--doc-mix", "code_repo"]
    with pytest.raises(SystemExit) as exit_:
        run_cli(main, argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "narrow the search with --doc-mix causal" in err and "training.global_batch_size" in err


@pytest.mark.parametrize(
    "argv,ngpu",
    [
        (["--model.flavor", "8B", "--training.seq_len", "131072", "--training.local_batch_size", "1"], 16),
        (["--model.flavor", "8B", "--parallelism.pipeline_parallel_schedule", "GPipe"], 32),
        (["--job.config_file", "train_configs/debug_cp.toml"], 4),
    ],
)
def test_the_bound_is_below_every_estimate_and_the_answer_is_the_exhaustive_ones(argv, ngpu):
    """Every plan's step is at least its closed-form lower bound (so no plan that could be within 2% of the
    fastest is left out), and the bounded search recommends what estimating every plan recommends."""
    from titan_cp.plan import search  # noqa: PLC0415
    from titan_cp.plan.cost import Stack, causal_pairs, step_lower_bound  # noqa: PLC0415

    cfg = load_config(argv)
    every, bounded = plan(cfg, ngpu, exhaustive=True), plan(cfg, ngpu)
    for e in every.estimates:
        lower = step_lower_bound(
            search._setting(e.candidate, e.workload, e.device, Stack()), causal_pairs(e.workload.rows)
        )
        assert lower <= e.cost.step * (1 + 1e-9), (e.candidate, lower, e.cost.step)
    assert bounded.best.candidate == every.best.candidate and len(bounded.estimates) < len(every.estimates)
    skipped = bounded.skipped
    assert len(bounded.estimates) + skipped.no_fit + skipped.bounded == len(every.estimates)
