"""The planner (``titan_cp.plan``) against measurements and published tables.

- Memory: on the debug model the planner's saved bytes per rank equal what
  ``benchmarks.memory`` counts (exact) and its peak is within 10% of the allocator's peak,
  CP 1, 2, 4, AC none and full; on a TP 2 mesh (saved bytes exact, peak within 10%) and on a
  PP 2 mesh under 1F1B with 4 microbatches (each stage's peak within 10%). Sequence 1024 instead
  of the issue's 8192 for CP: the CP 8 pool on this 2-core machine takes minutes at 8192 (one run
  there, CP 8 full AC: saved 9,527,328 bytes exact, peak 44.2 MB predicted vs 45.4 MB measured),
  and the bars hold alike at 1024, 2048 and 8192.
- Communication: the planner's CP bytes per rank equal the counters (``count_comm``) for every
  strategy, and on the composition meshes of ``tests/test_composition.py`` (exact).
- Time, against torchtitan's December 2024 H100 benchmark: Llama 3.1 8B FSDP x CP on 8 GPUs
  (fits, published order kept, each row within 20% where the model holds: see
  ``test_llama3_8b_cp_table``), and the held-out 70B / 405B runs (TP, PP, CP): each fits 96 GB
  and lands within 35%.
- ``import titan_cp.plan`` and a plan with the default (causal) mix need no numpy: tests/test_imports.py.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.memory import BYTE_VOCAB, measure_cp, measure_mesh
from titan_cp import plan as P
from titan_cp.config import load_config
from titan_cp.data.row_mixes import proportional_doc_lens
from titan_cp.families.llama3 import model_args

DEBUG = model_args("debugmodel_gqa", vocab_size=BYTE_VOCAB)
SEQ, DOCS = 1024, 4


def _cfg(**kw):
    return dict(
        dict(
            seq_len=SEQ,
            batch=1,
            docs=DOCS,
            flavor="debugmodel_gqa",
            vocab_size=BYTE_VOCAB,
            strategy="ring",
            balance="doc_zigzag",
            ac="none",
            ulysses=1,
        ),
        **kw,
    )


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_memory_matches_bench_memory(dist_pools, cp):
    for ac in ("none", "full"):
        got = measure_cp(cp, _cfg(ac=ac), runner=dist_pools.run)
        want = P.step_peak_bytes(DEBUG, SEQ // cp, DOCS, ac=ac, act_bytes=4, cp=cp)
        for r in got:
            assert r["saved_bytes"] == want["saved"], (cp, ac)
            assert r["grad_bytes"] == want["grads"]
        peak = max(r["peak_bytes"] for r in got)
        assert abs(want["peak"] - peak) <= 0.10 * peak, (cp, ac, want["peak"], peak)
        sent = max(r["bytes_sent"] for r in got)
        docs = [proportional_doc_lens(SEQ, DOCS)]
        assert sent == P.cp_bytes_per_rank(
            DEBUG, SEQ, 1, "ring", cp, ac=ac, act_bytes=4, doc_rows=docs, balance="doc_zigzag"
        )


@pytest.mark.parametrize("strategy,ulysses", [("allgather", 1), ("ulysses", 4), ("hybrid", 2)])
def test_saved_and_comm_bytes_per_strategy(dist_pools, strategy, ulysses):
    seq = 512
    for ac in ("none", "full"):
        got = measure_cp(4, _cfg(seq_len=seq, strategy=strategy, ulysses=ulysses, ac=ac), runner=dist_pools.run)
        saved = P.saved_bytes(DEBUG, seq // 4, DOCS, strategy=strategy, cp=4, ac=ac, act_bytes=4, ulysses=ulysses)
        docs = [proportional_doc_lens(seq, DOCS)]
        for rank, r in enumerate(got):
            sent = P.cp_bytes_per_rank(
                DEBUG,
                seq,
                1,
                strategy,
                4,
                ulysses=ulysses,
                ac=ac,
                act_bytes=4,
                doc_rows=docs,
                balance="doc_zigzag",
                rank=rank,
            )
            assert r["saved_bytes"] == saved - _unsent_kv_bytes(strategy, seq, docs, rank, ac), (strategy, ac)
            assert r["bytes_sent"] == sent, (strategy, ac)


def _unsent_kv_bytes(strategy: str, seq: int, docs, rank: int, ac: str) -> int:
    """All-gather keeps the K/V it received, not the whole row's: the rows of other ranks this one's
    queries cannot see are not kept (the planner's per-token figure is the dense case). Under full AC
    only the recomputed block's are alive at once, and they are not among the saved bytes."""
    if strategy != "allgather" or ac == "full":
        return 0
    from titan_cp.attention.tiling import CAUSAL, tile_mask
    from titan_cp.layout import get_layout

    layout = get_layout(seq, 4, "doc_zigzag", docs)
    received = sum(len(tile_mask(layout, (rank,), (j,), CAUSAL).key_rows(1)) for j in range(4) if j != rank)
    missing = 3 * layout.local_len - received  # rows of the three other shards not received
    return DEBUG.n_layers * missing * 2 * DEBUG.kv_heads * DEBUG.head_dim * 4


def _composition_comm(rank, world, combo: dict) -> int:
    """CP bytes this rank sent in one forward + backward of the tiny model on ``combo``'s mesh."""
    from tests.test_composition import build_combo, local_microbatch, make_batch
    from titan_cp.attention.comm import count_comm
    from titan_cp.loss import IGNORE_INDEX
    from titan_cp.step import forward_backward

    pd, options, built, loss_fn = build_combo(world, combo)
    full = make_batch(0)
    loss_fn.global_valid_tokens = int((full.labels != IGNORE_INDEX).sum())
    local = local_microbatch(pd, built, full)
    # the first step also runs the pipeline's shape inference (a forward, and on the last stage
    # a backward, of one microbatch): count a steady-state step
    forward_backward(built.parts, local, loss_fn, built.schedule, built.has_first, built.has_last)
    with count_comm() as c:
        forward_backward(built.parts, local, loss_fn, built.schedule, built.has_first, built.has_last)
    return c.bytes_sent


COMPOSITIONS = {
    "cp4_ulysses": dict(cp=4, strategy="ulysses", balance="zigzag"),
    "fsdp2_cp2_allgather": dict(dp_shard=2, cp=2, strategy="allgather"),
    "tp2_cp2_ring": dict(tp=2, cp=2, strategy="ring"),
    "pp2_cp2_gpipe_ring": dict(pp=2, cp=2, strategy="ring", schedule="GPipe"),
    "hybrid_cp4": dict(cp=4, ulysses=2, strategy="hybrid"),
    "hsdp2_cp2_ring_ac": dict(dp_replicate=2, cp=2, strategy="ring", ac="full"),
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_comm_bytes_on_composition_meshes(dist_pools, name):
    from tests.test_composition import ROWS, make_batch
    from tests.test_composition import SEQ as CSEQ

    combo = COMPOSITIONS[name]
    world = 4
    sent = dist_pools.run(world, _composition_comm, combo)
    args = model_args("tiny", n_layers=combo.get("n_layers", 2))
    dp = combo.get("dp_shard", 1) * combo.get("dp_replicate", 1)
    pp = combo.get("pp", 1)
    full = [[n for n in row if n] for row in make_batch(0).doc_lens.tolist()]
    per_rank = []
    for d in range(dp):  # each dp rank's rows, in pipeline microbatches of their own documents
        rows = full[d * ROWS // dp : (d + 1) * ROWS // dp]
        micro = [rows[i : i + len(rows) // 2] for i in range(0, len(rows), len(rows) // 2)] if pp > 1 else [rows]
        for c in range(combo["cp"]):
            per_rank.append(
                sum(
                    P.cp_bytes_per_rank(
                        args,
                        CSEQ,
                        len(mb),
                        combo["strategy"],
                        combo["cp"],
                        combo.get("tp", 1),
                        combo.get("ulysses", 1),
                        args.n_layers // pp,
                        combo.get("ac", "none"),
                        4,
                        doc_rows=mb,
                        balance=combo.get("balance", "doc_zigzag"),
                        rank=c,
                    )
                    for mb in micro
                )
            )
    want = max(per_rank)
    assert max(sent) == want, (name, sent, want)


def test_saved_formula_by_hand():
    """One block of the debug model, fp32, per token: norms 2052 each, wq input 1024, attention
    (q, out 1024 each; k, v 256 each; lse 64) 2624, feed-forward 3 x 3072 + 1024 + 3072."""
    block = P.saved_bytes_per_token(DEBUG, layers=1, first=False, last=False) - 64  # rope cos/sin
    assert block == 2052 + 1024 + 2624 + 3 * 3072 + 1024 + 3072 + 2052


def test_published_table_fits_and_order():
    rows = P.compare(P.LLAMA3_8B_CP)
    assert all(r.fits for r in rows)
    tps = [r.tokens_per_second_per_gpu for r in rows]
    assert tps == sorted(tps, reverse=True) and len(set(tps)) == len(tps)
    assert [r.run.tokens_per_second_per_gpu for r in rows] == [3890, 2540, 1071, 548]


def test_llama3_8b_cp_table():
    """Within 20% of torchtitan's Table 2 at 32K and 64K (CP 1, 2). At 128K and 256K (CP 4, 8) the
    planner stays optimistic, 1.47x and 1.63x (docs/planning.md): the four rows run the same
    kernel shapes (32K local tokens, 16K zigzag chunks), so no per-step cost separates them, while
    the table's time per ring step is 1.6x larger at CP 4 and 8 than at CP 2. Asserted as it stands,
    so that a change to the time model that moves it is seen."""
    ratios = [r.ratio for r in P.compare(P.LLAMA3_8B_CP)]
    assert all(abs(x - 1) <= 0.20 for x in ratios[:2]), ratios
    assert all(1.2 < x < 1.7 for x in ratios[2:]), ratios


def test_held_out_70b_405b_fit_and_within_35_percent():
    rows = P.compare(P.HELD_OUT)
    assert {r.run.flavor for r in rows} == {"70B", "405B"} and {r.run.pp for r in rows} == {1, 8}
    for r in rows:
        assert r.fits and r.memory_gib < 96 * 1e9 / 2**30, (r.run, r.memory_gib)
        assert abs(r.ratio - 1) <= 0.35, (r.run, r.tokens_per_second_per_gpu)


def test_cli_prints_plans_and_launch_line(capsys, tmp_path):
    png = tmp_path / "plan.png"
    rc = P.main(
        [
            "--ngpu",
            "4",
            "--gpu",
            "cpu",
            "--model.flavor",
            "debugmodel_gqa",
            "--training.seq_len",
            "4096",
            "--training.local_batch_size",
            "1",
            "--plot",
            str(tmp_path),  # a folder: plan.png in it (never <folder>.png beside it)
            "--all",  # every plan estimated, not only those that can be the fastest
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    keys = {
        "strategy",
        "dp_shard",
        "dp_replicate",
        "cp",
        "tp",
        "pp",
        "seq_len",
        "memory_bytes_per_rank",
        "fits",
        "comm_bytes_per_rank",
        "step_seconds",
        "tokens_per_second_per_gpu",
        "mfu",
        "recommended",
    }
    assert recs and all(keys <= r.keys() for r in recs)
    assert recs[0]["recommended"] and not any(r["recommended"] for r in recs[1:])
    assert {r["strategy"] for r in recs} >= {"none", "ring", "allgather", "ulysses", "hybrid"}
    assert "torchrun --standalone --nproc-per-node 4 -m titan_cp.train" in out
    assert "--rdzv-backend c10d" in out and "context_parallel_degree" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and f"plot: {png}" in out
    assert P.plot_path(str(tmp_path / "x.png")) == tmp_path / "x.png"
    for r in recs:
        parts = r["memory_parts"]
        assert sum(parts.values()) == r["memory_bytes_per_rank"]


@pytest.mark.parametrize(
    "argv,key",
    [
        (["--ngpu", "8", "--parallelism.context_parallel_degree", "3"], "parallelism."),
        (["--ngpu", "8", "--gpu", "tpu"], "--gpu"),
        (
            ["--ngpu", "8", "--training.seq_len", "1001", "--parallelism.context_parallel_degree", "2"],
            "training.seq_len",
        ),
        (["--ngpu", "8", "--nnodes", "3"], "--nnodes"),
        (["--ngpu", "8", "--doc-mix", "novels"], "--doc-mix"),
        (["--ngpu", "8", "--hbm-gb", "0"], "--hbm-gb must be a positive finite number"),
        (["--ngpu", "8", "--hbm-gb", "-80"], "--hbm-gb must be a positive finite number"),
        (["--ngpu", "8", "--hbm-gb", "nan"], "--hbm-gb must be a positive finite number"),
        (["--ngpu", "8", "--matmul-speedup", "0"], "--matmul-speedup must be a positive finite number"),
        (["--ngpu", "8", "--matmul-speedup", "-1"], "--matmul-speedup must be a positive finite number"),
        (["--ngpu", "8", "--matmul-speedup", "inf"], "--matmul-speedup must be a positive finite number"),
        (["--ngpu", "8", "--top", "-3"], "--top must be 0"),
        (["--ngpu", "8", "--plot", "/no/such/folder/plan.png"], "--plot '/no/such/folder/plan.png': the folder"),
        (["--ngpu", "8", "--plot", "plan.txt"], "--plot 'plan.txt': name a .png file (e.g. --plot plan.png) or an"),
        (["--ngpu", "8", "--plot", "/"], "--plot '/': would write '/plan.png' at the filesystem root"),
        (["--ngpu", "8", "--plot", "/plan.png"], "--plot '/plan.png': would write '/plan.png' at the filesystem root"),
        (["--ngpu", "0"], "--ngpu must be a positive integer"),
    ],
)
def test_bad_input_names_the_key(capsys, argv, key):
    """One line on stderr naming the option or key, exit status 2, nothing computed or printed."""
    from titan_cp.errors import run_cli

    with pytest.raises(SystemExit) as exit_:
        run_cli(P.main, argv + ["--model.flavor", "debugmodel_gqa"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert key in err and len(err.strip().splitlines()) == 1, err


def test_nnodes_puts_the_ring_across_nodes():
    cfg = load_config(
        [
            "--model.flavor",
            "8B",
            "--training.seq_len",
            "262144",
            "--training.local_batch_size",
            "1",
            "--activation_checkpoint.mode",
            "full",
        ]
    )
    result = P.plan(cfg, 16, "h100", nnodes=2, exhaustive=True)
    recs = [P.record(e, result) for e in result.estimates]
    r = next(r for r in recs if r["cp"] == 16 and r["strategy"] == "ring")
    assert r["comm_detail"]["cp"]["link"] == "inter" and r["comm_bytes_per_rank"]["inter"] > 0
    h = next(r for r in recs if r["cp"] == 16 and r["strategy"] == "hybrid" and r["ulysses_degree"] == 8)
    assert h["comm_detail"]["cp_ulysses"]["link"] == "intra" and h["comm_detail"]["cp_ring"]["link"] == "inter"


MESH = dict(flavor="debugmodel_gqa", n_layers=4, vocab_size=2048, seq_len=512, batch=1, docs=4)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_memory_on_a_tp_mesh(dist_pools, ac):
    """Sequence parallelism shards the norms' tensors and the block inputs over tp; the linears keep
    their gathered inputs. Saved bytes exact, the peak within 10% (of the least of 3 steps: an
    asynchronous collective's buffers may outlive their use by a varying margin, see measure_mesh)."""
    got = measure_mesh(dict(MESH, tp=2, ac=ac, repeats=3), dist_pools.run)
    args = model_args(MESH["flavor"], n_layers=MESH["n_layers"], vocab_size=MESH["vocab_size"])
    want = P.step_peak(P.RankModel(args, tp=2, act_bytes=4, ac=ac), P.Stage(args.n_layers), 512, 4)
    assert all(r["saved_bytes"] == want.saved for r in got), (ac, [r["saved_bytes"] for r in got], want.saved)
    peak = max(r["peak_bytes"] for r in got)
    assert abs(want.peak - peak) <= 0.10 * peak, (ac, want.peak, peak)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_memory_on_a_pp_mesh(dist_pools, ac):
    """1F1B over 2 stages with 4 microbatches: the first stage holds 2 microbatches' activations and,
    after the first backward, every gradient of the stage; the last one 1 and the loss. Each stage's
    peak within 10% of the allocator's."""
    got = measure_mesh(dict(MESH, pp=2, batch=4, microbatches=4, ac=ac), dist_pools.run)
    args = model_args(MESH["flavor"], n_layers=MESH["n_layers"], vocab_size=MESH["vocab_size"])
    w = P.Workload(args, 512, (tuple(proportional_doc_lens(512, 4)),) * 4, ac=ac, act_bytes=4)
    first, last = P.evaluate(P.Candidate("ring", 1, 1, 1, 1, 2), w, P.device("cpu", ngpu=2), P.Stack()).stages
    for r in got:
        want = (first if r["first"] else last).step.peak
        assert abs(want - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (ac, r["first"], want, r["peak_bytes"])
