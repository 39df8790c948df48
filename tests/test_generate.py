"""Generation and scoring under the CP layout (titan_cp.generate, titan_cp.attention.decode).

The oracle of one process is the model's own forward on the whole sequence (prompt and the
tokens generated so far, no cache); the CP runs (CP 2, 3, 4: ring, all-gather, Ulysses, hybrid,
TP x CP, sliding windows with sinks) are held to one process: the same greedy tokens for prompts
of 1, 7 and 3,000 tokens and for a batch of different lengths, every step's logits within 1e-4
(fp32), the same sampled tokens for a seed, the cache holding ceil(tokens / cp) per rank, one
collective of (B, H, E + 1) fp32 per decode step and layer, scores equal to the training
cross-entropy. fp32 throughout; the parallel runs add the same numbers in another order
(~1e-6), so 1e-4 on logits and log-likelihoods is loose and still far below a wrong mask.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from titan_cp.attention.comm import count_comm
from titan_cp.attention.decode import KeyRanges, decode_partial, merge_stacked
from titan_cp.attention.kernels import get_kernel
from titan_cp.attention.merge import apply_sinks_
from titan_cp.config import load_config
from titan_cp.errors import UserError, run_cli
from titan_cp.families.llama3 import hf_checkpoint, model_args
from titan_cp.generate import Generator, Sampling, build_generation_model, plan_owners
from titan_cp.generate.cli import main, prepare
from titan_cp.generate.needle import accuracy_grid, needle_case
from titan_cp.generate.prompts import read_prompts
from titan_cp.generate.sampling import nucleus
from titan_cp.loss import IGNORE_INDEX
from titan_cp.mesh import ParallelDims
from titan_cp.testing.logs import captured

TOL = 1e-4
NEW = 6  # tokens generated per prompt
BYTE_VOCAB = 259
VARIANTS = {
    "tiny": {},
    "tiny_swa": {},  # every other layer a 5-token sliding window, with sinks
    "tiny6": {"dim": 96, "n_heads": 6, "n_kv_heads": 3},  # heads that Ulysses splits over 3 ranks
    "tiny_chunk": {"attention_pattern": "CF", "chunk": 4},  # every other layer in 4-token chunks (Llama 4)
}


def args_of(variant: str):
    return model_args("tiny_swa" if variant == "tiny_swa" else "tiny", **VARIANTS[variant])


def prompt_sets() -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    p = {n: torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 50, 3000)}
    return {"1": [p[1]], "7": [p[7]], "3000": [p[3000]], "batch": [p[7], p[3000], p[1], p[50]]}


def score_pairs() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 40, 600)]
    continuations = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 1, 30)]
    return contexts, continuations


SAMPLING = Sampling(temperature=0.9, top_p=0.9, seed=5)


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread in this process while a test runs (as the pool's ranks): on a shared machine
    two threads per process run these tiny shapes ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def greedy_batch(gen: Generator, prompts) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Greedy decoding step by step (what ``generate`` does, unrolled): the tokens and logits per
    prompt, and what the first decode step sent (counted) and the cache holds at the end."""
    logits, state = gen.prefill(prompts, NEW)
    every = [logits]
    tokens = [[t] for t in logits.argmax(-1).tolist()]
    traffic = {}
    for _ in range(1, NEW):
        with count_comm() as c:
            logits = gen.decode(state, list(range(len(prompts))), [t[-1] for t in tokens])
        traffic = traffic or {"bytes": c.bytes_sent, "calls": c.calls}
        every.append(logits)
        for t, nxt in zip(tokens, logits.argmax(-1).tolist()):
            t.append(nxt)
    cache = state.cache
    traffic.update(held=cache.tokens_held, capacity=cache.capacity, cache_bytes=cache.nbytes())
    return tokens, list(torch.stack(every, 1)), traffic


def requests(gen: Generator, sets=None) -> dict:
    """Every measured request of one model: greedy per prompt set (``sets``, default all: tokens and
    logits; the batch step by step, its traffic counted), sampled tokens, scores."""
    out = {}
    for name, prompts in prompt_sets().items():
        if sets is not None and name not in sets:
            continue
        if name == "batch":
            tokens, logits, out["traffic"] = greedy_batch(gen, prompts)
            out[name] = (tokens, logits)
            continue
        res = gen.generate(prompts, NEW, keep_logits=True)
        out[name] = ([r.tokens for r in res], [torch.stack(r.logits) for r in res])
    batch = prompt_sets()["batch"]
    out["sampled"] = [r.tokens for r in gen.generate([batch[0], *batch[2:]], NEW, SAMPLING)]
    out["scores"] = [s.logprobs for s in gen.score(*score_pairs())]
    return out


# --------------------------------------------------------------------------------------------
# one process: the cache path against the model's own forward


@pytest.mark.parametrize("variant", ["tiny", "tiny_swa", "tiny_chunk"])
def test_one_process_decode_equals_the_models_forward_on_the_whole_sequence(variant):
    model = build_generation_model(args_of(variant))
    gen = Generator(model)
    prompts = prompt_sets()["batch"][:3] + [prompt_sets()["batch"][3][:12]]
    with torch.no_grad():
        for prompt, res in zip(prompts, gen.generate(prompts, NEW, keep_logits=True)):
            whole = torch.tensor(prompt + res.tokens[:-1])[None]
            want = model(whole)[0, len(prompt) - 1 :]
            assert (torch.stack(res.logits) - want).abs().max().item() <= 1e-5
            assert res.tokens == want.argmax(-1).tolist() and res.finish_reason == "length"
            assert res.prompt_tokens == len(prompt) and len(res.tokens) == NEW


def test_stop_tokens_end_one_prompt_and_leave_the_others():
    gen = Generator(build_generation_model(args_of("tiny")))
    prompts = prompt_sets()["batch"]
    free = gen.generate(prompts, NEW)
    stop = free[0].tokens[2]
    first = free[0].tokens.index(stop)
    stopped = gen.generate(prompts, NEW, stop_tokens=[stop])
    assert stopped[0].tokens == free[0].tokens[: first + 1] and stopped[0].finish_reason == "stop"
    for a, b in zip(free[1:], stopped[1:]):
        cut = a.tokens.index(stop) + 1 if stop in a.tokens else NEW
        assert b.tokens == a.tokens[:cut]
        assert b.finish_reason == ("stop" if stop in a.tokens else "length")


def test_decoding_past_the_prefills_plan_is_an_error():
    gen = Generator(build_generation_model(args_of("tiny")))
    logits, state = gen.prefill([[1, 2, 3]], new_tokens=2)  # room for the one token fed back
    gen.decode(state, [0], logits.argmax(-1).tolist())
    with pytest.raises(ValueError, match="prompt 0 has fed the 1 token the prefill planned for"):
        gen.decode(state, [0], [5])
    with pytest.raises(ValueError, match="distinct ascending prompt indices below 1"):
        gen.decode(state, [1], [5])
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        gen.generate([[1]], 0)
    with pytest.raises(ValueError, match=r"prompts\[1\] has no tokens"):
        gen.generate([[1], []], 2)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds a token that is not an id below the vocabulary size 256"):
        gen.generate([[1, 256]], 2)
    with pytest.raises(
        ValueError, match=r"prompts\[0\] has 1 token \(\+ 16777216 to generate\), more than the 16777216"
    ):
        gen.generate([[1]], 2**24 + 1)  # RoPE's exact positions; the flavor's max_seq_len (4096) is informational


def test_scores_equal_the_training_cross_entropy_sum():
    model = build_generation_model(args_of("tiny_swa"))
    contexts, continuations = score_pairs()
    scores = Generator(model).score(contexts, continuations)
    for c, x, s in zip(contexts, continuations, scores):
        tokens = torch.tensor(c + x)[None]
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[0, len(c) - 1 : -1] = torch.tensor(x)
        with torch.no_grad():
            ce_sum = model(tokens, labels=labels).item()
        assert len(s.logprobs) == len(x)
        assert s.loglik == pytest.approx(-ce_sum, rel=TOL, abs=TOL)
    # greedy: a continuation that is the model's own greedy output
    out = Generator(model).generate([contexts[1]], 4)[0].tokens
    assert Generator(model).score([contexts[1]], [out])[0].greedy
    assert not Generator(model).score([contexts[1]], [[(out[0] + 1) % 256, *out[1:]]])[0].greedy


def test_sampling_is_seeded_per_prompt_and_respects_top_p():
    probs = torch.tensor([0.5, 0.05, 0.3, 0.15], dtype=torch.float64)
    p, ids = nucleus(probs, 0.75)
    assert ids.tolist() == [0, 2] and p.tolist() == pytest.approx([0.625, 0.375])
    assert nucleus(probs, 1e-9)[1].tolist() == [0] and nucleus(probs, 1.0)[1].tolist() == [0, 2, 3, 1]
    gen = Generator(build_generation_model(args_of("tiny")))
    prompts = prompt_sets()["batch"]
    batch = gen.generate(prompts, NEW, SAMPLING)
    alone = gen.generate([prompts[2]], NEW, SAMPLING, prompt_ids=[2])
    assert alone[0].tokens == batch[2].tokens  # the draw depends on (seed, prompt id) only
    other = gen.generate(prompts, NEW, Sampling(0.9, 0.9, seed=6))
    assert [r.tokens for r in other] != [r.tokens for r in batch]
    greedy = gen.generate(prompts, NEW, Sampling(0.0, 0.5, seed=3))
    assert [r.tokens for r in greedy] == [r.tokens for r in gen.generate(prompts, NEW)]
    for bad in (dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(**bad)


# --------------------------------------------------------------------------------------------
# the pieces: the merge, the key ranges, the owner plan


def _dense(q, k, v, sinks=None):
    """fp64 attention of q (B, H, E) over all of k, v (N, K, E) (GQA heads expanded), with sinks."""
    groups = q.shape[1] // k.shape[1]
    s = torch.einsum("bhe,nhe->bhn", q.double(), k.double().repeat_interleave(groups, 1)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, -1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double())
    return torch.einsum("bhn,nhe->bhe", torch.exp(s - lse[..., None]), v.double().repeat_interleave(groups, 1))


@pytest.mark.parametrize("kernel", ["math", "cpu_varlen"])
def test_partials_over_disjoint_ranges_merge_to_attention_over_all_keys(kernel):
    """Three "ranks" each hold a third of every query's keys, between rows they must not read
    (NaN); merged, the partials equal dense attention over the keys, sinks folded in after."""
    torch.manual_seed(0)
    b, h, e, lens = 3, 4, 8, (1, 5, 40)
    q = torch.randn(b, h, e)
    keys = [torch.randn(n, 2, e) for n in lens]
    vals = [torch.randn(n, 2, e) for n in lens]
    sinks = torch.randn(h)
    outs, lses = [], []
    for r in range(3):
        k_cache, v_cache, ranges = torch.full((100, 2, e), math.nan), torch.full((100, 2, e), math.nan), []
        at = 3
        for i in range(b):
            mine = list(range(r, lens[i], 3))  # a query of length 1 has no key on ranks 1, 2
            k_cache[at : at + len(mine)], v_cache[at : at + len(mine)] = keys[i][mine], vals[i][mine]
            ranges.append((at, at + len(mine)))
            at += len(mine) + 2  # unused rows between ranges
        out, lse = decode_partial(
            q, k_cache, v_cache, KeyRanges.build(ranges, "cpu"), get_kernel(kernel, "cpu", q.dtype), e**-0.5
        )
        outs.append(out)
        lses.append(lse)
    out, lse = merge_stacked(torch.stack(outs), torch.stack(lses))
    lse_HB = lse.t().contiguous()
    apply_sinks_(out, lse_HB, sinks)
    for i in range(b):
        want = _dense(q[i : i + 1], keys[i], vals[i], sinks)
        assert (out[i : i + 1].double() - want).abs().max().item() <= 1e-5
    empty = KeyRanges.build([(4, 4), (0, 0)], "cpu")
    assert empty.seg is None and empty.rows.numel() == 0


def test_owner_plan_keeps_every_rank_within_ceil_tokens_over_cp():
    g = torch.Generator().manual_seed(0)
    for cp in (1, 2, 3, 4, 8):
        for _ in range(5):
            held = torch.randint(0, 20, (4, cp), generator=g)
            per_rank = held.sum(0).tolist()
            if max(per_rank) > math.ceil(sum(per_rank) / cp):  # the layout starts balanced
                continue
            owners = plan_owners(held.tolist(), 9)
            for t in range(9):
                for b in range(4):
                    per_rank[owners[b][t]] += 1
                    assert max(per_rank) <= math.ceil(sum(per_rank) / cp)
    assert plan_owners([[3, 0], [0, 2]], 2) == [[1, 1], [0, 0]]


# --------------------------------------------------------------------------------------------
# under CP: every strategy against one process


# (variant, strategy, balance, tp, ulysses degree); the bars' cases run every prompt set, the
# others (windows and sinks, hybrid, tp x cp) the batch, which holds the same prompts
BARS = ("1", "7", "3000", "batch")
CASES = {
    2: [
        ("tiny", "ring", "doc_zigzag", 1, None, BARS),
        ("tiny", "allgather", "doc_zigzag", 1, None, BARS),
        ("tiny", "ulysses", "zigzag", 1, None, BARS),
        ("tiny_swa", "ring", "doc_local", 1, None, ("batch",)),
        ("tiny_chunk", "allgather", "doc_zigzag", 1, None, ("batch",)),
    ],
    3: [
        ("tiny", "ring", "doc_zigzag", 1, None, BARS),
        ("tiny", "allgather", "contiguous", 1, None, BARS),
        ("tiny6", "ulysses", "doc_zigzag", 1, None, BARS),
    ],
    4: [
        ("tiny", "ring", "doc_zigzag", 1, None, BARS),
        ("tiny", "allgather", "doc_zigzag", 1, None, BARS),
        ("tiny", "ulysses", "doc_zigzag", 1, None, BARS),
        ("tiny", "hybrid", "doc_zigzag", 1, 2, ("batch",)),
        ("tiny_swa", "ring", "doc_zigzag", 2, None, ("batch",)),  # tp 2 x cp 2: heads and sinks split over tp
    ],
}


def _under_cp(rank, world, cases):
    results = []
    for variant, strategy, balance, tp, ulysses, sets in cases:
        dims = ParallelDims(1, 1, world // tp, tp, 1, world, cp_ulysses=ulysses)
        dims.build_mesh("cpu")
        model = build_generation_model(args_of(variant), dims, strategy, balance)
        gen = Generator(model)
        results.append(requests(gen, sets))
    return results


@pytest.fixture(scope="module")
def one_process():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {v: requests(Generator(build_generation_model(args_of(v)))) for v in VARIANTS}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", sorted(CASES))
def test_cp_generation_equals_one_process(dist_pools, one_process, world):
    by_rank = dist_pools.run(world, _under_cp, CASES[world], timeout=600)
    batch_tokens = sum(len(p) for p in prompt_sets()["batch"]) + len(prompt_sets()["batch"]) * (NEW - 1)
    for i, (variant, strategy, balance, tp, _, sets) in enumerate(CASES[world]):
        want, cp = one_process[variant], world // tp
        args = args_of(variant)
        for rank, results in enumerate(by_rank):
            got, case = results[i], (variant, strategy, balance, tp, rank)
            for name in sets:
                assert got[name][0] == want[name][0], (case, name)
                err = max((a - b).abs().max().item() for a, b in zip(got[name][1], want[name][1]))
                assert err <= TOL, (case, name, err)
            assert got["sampled"] == want["sampled"], case
            for a, b in zip(got["scores"], want["scores"]):
                assert a == pytest.approx(b, abs=TOL), case
            t = got["traffic"]
            heads = args.n_heads // tp
            assert t["calls"] == args.n_layers, case  # one collective per layer
            assert t["bytes"] == args.n_layers * (cp - 1) * 4 * heads * (args.head_dim + 1) * 4, case
            assert t["held"] <= t["capacity"] <= math.ceil(batch_tokens / cp), (case, t)
            kv = args.kv_heads // tp
            assert t["cache_bytes"] == 2 * args.n_layers * t["capacity"] * kv * args.head_dim * 4, case
        # every token's K/V is held once, by one rank of each tp group
        assert sum(r[i]["traffic"]["held"] for r in by_rank) == tp * batch_tokens


# --------------------------------------------------------------------------------------------
# the command: weights from each kind of checkpoint, prompt files, JSON lines, needle heatmap


def _tiny_state():
    model = build_generation_model(model_args("tiny", vocab_size=BYTE_VOCAB), seed=7)
    return model, get_model_state_dict(model)


def _write_checkpoints(tmp_path):
    """A titan_cp step, a torchtitan DCP folder and a Hugging Face folder of the same weights."""
    from safetensors.torch import save_file

    model, state = _tiny_state()
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "run" / "checkpoint" / "step-2"))
    dcp.save(dict(state), checkpoint_id=str(tmp_path / "torchtitan"))
    (tmp_path / "hf").mkdir()
    save_file(
        {k: v.contiguous() for k, v in hf_checkpoint.to_hf(state, model.args).items()},
        tmp_path / "hf" / "model.safetensors",
    )
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_checkpoint.hf_config(model.args)))
    return model


def _cli_argv(tmp_path, *extra):
    return [
        "--model.flavor", "tiny",
        "--job.dump_folder", str(tmp_path / "run"),
        "--parallelism.context_parallel_degree", "2",
        "--generate.max_new_tokens", str(NEW),
        *extra,
    ]  # fmt: skip


def _run_main(rank, world, argvs):
    """``main`` of each argv, and what this rank logged and warned meanwhile."""
    with captured() as out:
        results = [main(argv) for argv in argvs]
    return results, out


def test_command_generates_scores_and_draws_the_needle_heatmap(dist_pools, tmp_path):
    model = _write_checkpoints(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Remember these facts."}) + "\n\n" + json.dumps({"prompt": "a"}) + "\n")
    text = tmp_path / "prompt.txt"
    text.write_text("fact @q1w2e3.\n" * 40)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Recall @", "continuation": "q1w2e3"}) + "\n")
    weights = {
        "titan_cp": ["--checkpoint.enable"],
        "torchtitan": ["--checkpoint.initial_load_path", str(tmp_path / "torchtitan")],
        "hf": ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"],
    }
    argvs = [_cli_argv(tmp_path, *w, "--generate.prompt_file", str(prompts), f"--generate.output_file={k}.jsonl")
             for k, w in weights.items()]  # fmt: skip
    argvs.append(_cli_argv(tmp_path, *weights["titan_cp"], "--generate.prompt_file", str(text),
                           "--generate.temperature", "0.7", "--generate.output_file", "text.jsonl"))  # fmt: skip
    argvs.append(_cli_argv(tmp_path, *weights["titan_cp"], "--generate.task", "score",
                           "--generate.prompt_file", str(pairs), "--generate.output_file", "score.jsonl"))  # fmt: skip
    needle = ["--generate.task", "needle", "--generate.needle_lengths", "64,96", "--generate.needle_depths", "0,0.5,1",
              "--generate.needle_trials", "1", "--generate.output_file", "needle.jsonl"]  # fmt: skip
    argvs.append(_cli_argv(tmp_path, *weights["hf"], *needle))
    (ranks, (log, other_log)) = zip(*dist_pools.run(2, _run_main, argvs, timeout=600))
    assert [r["tokens"] for r in ranks[0][0]] == [r["tokens"] for r in ranks[1][0]]  # every rank: the same tokens
    # the log says once (rank 0) which weights each run loaded; torch warns of nothing titan_cp calls
    assert len(log.messages("loaded checkpoint")) == 3 and len(log.messages("loaded torchtitan")) == 1
    assert other_log.messages("loaded") == []
    assert [w for w in log.warnings + other_log.warnings if w[0] == "FutureWarning"] == []
    run = tmp_path / "run"
    tokenizer_prompts = [[256, *b"Remember these facts."], [256, *b"a"]]
    want = Generator(model).generate(tokenizer_prompts, NEW, stop_tokens=[257])
    for kind in weights:
        lines = [json.loads(x) for x in (run / f"{kind}.jsonl").read_text().splitlines()]
        assert [r["tokens"] for r in lines] == [w.tokens for w in want], kind
        assert [r["prompt_tokens"] for r in lines] == [22, 2] and [r["index"] for r in lines] == [0, 1]
        for r in lines:
            assert {"text", "time_to_first_token_s", "tokens_per_s", "finish_reason"} <= set(r)
            assert r["time_to_first_token_s"] > 0 and (r["tokens_per_s"] or 0) > 0
    sampled = json.loads((run / "text.jsonl").read_text())
    assert sampled["prompt_tokens"] == 1 + len("fact @q1w2e3.\n" * 40)
    want = Generator(model).generate([[256, *text.read_bytes()]], NEW, Sampling(0.7, 1.0, 0), [257])
    assert sampled["tokens"] == want[0].tokens
    (scored,) = [json.loads(x) for x in (run / "score.jsonl").read_text().splitlines()]
    ref = Generator(model).score([[256, *b"Recall @"]], [list(b"q1w2e3")])[0]
    assert scored["loglik"] == pytest.approx(ref.loglik, abs=TOL) and scored["continuation_tokens"] == 6
    records = [json.loads(x) for x in (run / "needle.jsonl").read_text().splitlines()]
    assert [(r["context_tokens"], r["depth"]) for r in records] == [(n, d) for n in (64, 96) for d in (0, 0.5, 1)]
    assert all(len(r["answer"]) == 6 and r["answer_loglik"] < 0 for r in records)
    assert (run / "needle_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_needle_contexts_have_the_length_and_the_fact_at_its_depth():
    from titan_cp.data import ByteTokenizer

    tok = ByteTokenizer()
    for depth in (0.0, 0.5, 1.0):
        case = needle_case(tok, 500, depth, 0)
        text = tok.decode(case.context)
        assert len(case.context) == 500 and text.endswith(f"\nRecall {case.key}")
        fact = text.index(f"fact {case.key}{case.value}.\n")
        room = 500 - 1 - len("Remember these facts.\n") - len(f"fact {case.key}{case.value}.\n") - len("\nRecall @")
        assert abs(fact - len("Remember these facts.\n") - depth * room) <= 80  # a sentence boundary
    assert needle_case(tok, 500, 0.5, 1).value != needle_case(tok, 500, 0.5, 0).value
    grid = accuracy_grid(
        [{"depth": 0.5, "context_tokens": 8, "correct": c} for c in (True, False, True, True)], [8], [0.5]
    )
    assert grid == [[0.75]]


# --------------------------------------------------------------------------------------------
# bad input: one line naming the key, before any process group


def _prepare(argv, world=1):
    return prepare(load_config(argv), world)


def test_lengths_beyond_a_flavors_informational_max_seq_len_run(tmp_path):
    """The tiny flavor's max_seq_len (4096) is informational, as in training (the main job trains it on
    8192-token rows): docs/generation.md's needle lengths, a longer prompt and its generation are taken."""
    _write_checkpoints(tmp_path)
    ok = ["--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable"]
    (tmp_path / "long.txt").write_text("x" * 5000)
    _prepare([*ok, "--generate.task", "needle", "--generate.needle_lengths", "512,1024,2048,4096,8192"])  # no error
    assert len(_prepare([*ok, "--generate.prompt_file", str(tmp_path / "long.txt")]).prompts[0]) == 5001
    from titan_cp.config.training import MAX_SEQ_LEN
    from titan_cp.families.llama3.model import MAX_POSITIONS

    assert MAX_POSITIONS == MAX_SEQ_LEN  # generation's bound is training's
    model = build_generation_model(args_of("tiny"))
    assert model.args.max_seq_len == 4096
    prompt = torch.randint(0, 256, (4100,), generator=torch.Generator().manual_seed(0)).tolist()
    (res,) = Generator(model).generate([prompt], 2, keep_logits=True)
    with torch.no_grad():
        want = model(torch.tensor(prompt + res.tokens[:1])[None])[0, len(prompt) - 1 :]
    assert (torch.stack(res.logits) - want).abs().max().item() <= 1e-5


def test_each_task_writes_its_own_file_by_default(tmp_path):
    """Scoring after generation (or the needle evaluation) keeps generation's results: the default
    output is ``<task>.jsonl``; a given ``generate.output_file`` is taken as it is."""
    _write_checkpoints(tmp_path)
    ok = ["--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable"]
    (tmp_path / "p.txt").write_text("hello")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "Recall @", "continuation": "q1"}) + "\n")
    runs = {
        "generate": ["--generate.prompt_file", str(tmp_path / "p.txt")],
        "score": ["--generate.task", "score", "--generate.prompt_file", str(tmp_path / "pairs.jsonl")],
        "needle": ["--generate.task", "needle", "--generate.needle_lengths", "64"],
    }
    outputs = {task: _prepare(ok + argv).output for task, argv in runs.items()}
    assert outputs == {task: tmp_path / "run" / f"{task}.jsonl" for task in runs}
    given = _prepare([*ok, *runs["score"], "--generate.output_file", "mine.jsonl"]).output
    assert given == tmp_path / "run" / "mine.jsonl"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--generate.max_new_tokens", "0"], "generate.max_new_tokens must be positive"),
        (["--generate.top_p", "0"], r"generate.top_p must be in \(0, 1\]"),
        (["--generate.top_p", "1.5"], r"generate.top_p must be in \(0, 1\]"),
        (["--generate.temperature", "-1"], "generate.temperature must be >= 0"),
        (["--generate.needle_depths", "0.5,2"], r"generate.needle_depths must be in \[0, 1\]"),
    ],
)
def test_bad_values_name_the_key(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


def test_bad_input_is_named_before_any_process_group(tmp_path, capsys):
    _write_checkpoints(tmp_path)
    ok = ["--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable"]
    files = {
        "empty.txt": "",
        "empty.jsonl": "\n\n",
        "bad.jsonl": '{"prompt": "x"}\n{"text": "y"}\n',
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "ok.txt").write_text("hello")
    cases = [
        (["--generate.prompt_file", str(tmp_path / "empty.txt")], "empty.txt' is empty: it holds no prompt"),
        (["--generate.prompt_file", str(tmp_path / "empty.jsonl")], "empty.jsonl' is empty"),
        (["--generate.prompt_file", str(tmp_path / "bad.jsonl")], r"bad.jsonl', line 2: no 'prompt' key"),
        (["--generate.prompt_file", str(tmp_path / "nope.txt")], "generate.prompt_file = .* does not exist"),
        ([], "generate.task = 'generate' needs generate.prompt_file"),
        (["--generate.prompt_file", str(tmp_path / "ok.txt"), "--generate.max_new_tokens", str(2**24)],
         r"6 tokens, with generate.max_new_tokens = 16777216, reach position 16777220, beyond the 16777216 "
         r"positions of model.flavor = 'tiny' \(RoPE's float32 positions, exact up to 2\*\*24"),
        (["--generate.prompt_file", str(tmp_path / "ok.txt"), "--generate.task", "score"],
         "scoring reads JSON lines"),
        (["--generate.prompt_file", str(tmp_path / "ok.txt"), "--generate.stop_tokens", "300"],
         "generate.stop_tokens has 300, beyond the tokenizer's vocabulary of 259"),
        (["--generate.prompt_file", str(tmp_path / "ok.txt"), "--model.flavor", "tiny_swa"],
         r"has no layers.0.attention.inner_attention.sinks, which model.flavor = 'tiny_swa' has"),
        (["--generate.prompt_file", str(tmp_path / "ok.txt"), "--model.flavor", "debugmodel_gqa"],
         r"tok_embeddings.weight has shape \(259, 64\), but model.flavor = 'debugmodel_gqa'"),
        (["--generate.prompt_file", str(tmp_path / "ok.txt"), "--checkpoint.enable", "false"],
         "generation needs trained weights"),
        (["--generate.task", "needle", "--generate.needle_lengths", "20"], "20 tokens cannot hold the header"),
        (["--generate.task", "lookup", "--validation.seq_len", "20"], "6 facts needs at least 25 tokens, got 20"),
        (["--generate.prompt_file", str(tmp_path / "ok.txt"), "--parallelism.context_parallel_degree", "2"],
         r"runs on parallelism.context_parallel_degree x tensor_parallel_degree = 2 x 1 = 2 ranks \(no data "
         r"parallelism\), but 1 rank was launched: launch 2, or set --parallelism.context_parallel_degree 1$"),
    ]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            _prepare(ok + extra)
    with pytest.raises(
        ValueError, match="= 1 rank \\(no data parallelism\\), but 2 ranks were launched: launch 1, or set"
    ):
        _prepare(ok + ["--generate.prompt_file", str(tmp_path / "ok.txt")], world=2)
    with pytest.raises(ValueError, match="runs no pipeline stages"):
        _prepare(
            ok + ["--generate.prompt_file", str(tmp_path / "ok.txt"), "--parallelism.pipeline_parallel_degree", "2"]
        )
    torchtitan = ["--checkpoint.initial_load_path", str(tmp_path / "torchtitan")]
    wrong = r"initial_load_path = .*: tok_embeddings.weight has shape \(259, 64\), but the model's .*model.flavor = 'debugmodel_gqa'"
    with pytest.raises(ValueError, match=wrong):
        _prepare(
            ok[:4]
            + torchtitan
            + ["--generate.prompt_file", str(tmp_path / "ok.txt"), "--model.flavor", "debugmodel_gqa"]
        )
    hf_wrong = ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"]
    with pytest.raises(ValueError, match=r"initial_load_path = .*model.embed_tokens.weight has shape \(259, 64\)"):
        _prepare(
            ok[:4] + hf_wrong + ["--generate.prompt_file", str(tmp_path / "ok.txt"), "--model.flavor", "debugmodel_gqa"]
        )
    assert not dist.is_initialized()
    with pytest.raises(SystemExit) as exit_info:  # the command's one line, exit status 2
        run_cli(main, ok + ["--generate.prompt_file", str(tmp_path / "empty.txt")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: generate.prompt_file")
    assert [r.prompt for r in read_prompts(str(tmp_path / "ok.txt"))] == ["hello"]


# --------------------------------------------------------------------------------------------
# Hugging Face models (model.name = "hf"): transformers computes all but the attention


HF_FAMILIES = {
    "qwen3": ("Qwen3Config", dict(head_dim=8, tie_word_embeddings=True)),  # q/k norms, tied embeddings
    # sliding window 4 on every other layer, per-head sinks, experts
    "gpt_oss": ("GptOssConfig", dict(head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                     num_local_experts=2, num_experts_per_tok=1)),
}  # fmt: skip


def _hf_folder(path, family: str):
    """A random tiny ``family`` model with a byte-level BPE tokenizer, saved as a Hugging Face folder."""
    transformers = pytest.importorskip("transformers")
    from titan_cp.integrations.hf_tiny import byte_tokenizer

    tokenizer = byte_tokenizer(path)
    name, fields = HF_FAMILIES[family]
    common = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config = getattr(transformers, name)(vocab_size=len(tokenizer), max_position_embeddings=512, **common, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) + (1.0 if "norm" in n else 0.0))
    model.save_pretrained(str(path))
    return path


def _hf_generator(folder, dims=None, strategy="ring", balance="doc_local"):
    from titan_cp.generate.hf_runner import build_hf_model
    from titan_cp.integrations.hf_folder import load_hf_weights

    model = build_hf_model(folder, dims, strategy, balance)
    load_hf_weights(model, folder)
    return Generator(model)


HF_PROMPTS = [[1, 5, 7, 9, 11, 40, 3], [2], [4, 8] * 100]


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_hugging_face_decode_equals_transformers_forward_on_the_whole_sequence(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    folder = _hf_folder(tmp_path, family)
    gen = _hf_generator(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        for prompt, res in zip(HF_PROMPTS, gen.generate(HF_PROMPTS, NEW, keep_logits=True)):
            want = ref(torch.tensor([prompt + res.tokens[:-1]])).logits[0, len(prompt) - 1 :]
            assert (torch.stack(res.logits) - want).abs().max().item() <= TOL * want.abs().max().item()
            assert res.tokens == want.argmax(-1).tolist()
        (score,) = gen.score([HF_PROMPTS[0]], [[3, 4, 5]])
        lp = ref(torch.tensor([HF_PROMPTS[0] + [3, 4, 5]])).logits[0].log_softmax(-1)
    assert score.loglik == pytest.approx(sum(lp[6 + j, t].item() for j, t in enumerate([3, 4, 5])), abs=TOL)


def _hf_under_cp(rank, world, folders):
    results = []
    for folder, strategy in folders:
        dims = ParallelDims(1, 1, world, 1, 1, world)
        dims.build_mesh("cpu")
        gen = _hf_generator(folder, dims, strategy)
        results.append([r.tokens for r in gen.generate(HF_PROMPTS, NEW, SAMPLING)])
    folder = folders[0][0]
    argv = [
        "--job.config_file", "train_configs/hf/qwen3_cp.toml",
        "--model.hf_assets_path", folder, "--checkpoint.initial_load_path", folder,
        "--parallelism.context_parallel_degree", str(world), "--training.mixed_precision_param", "float32",
        "--generate.prompt_file", f"{folder}-prompts.jsonl", "--generate.max_new_tokens", str(NEW),
    ]  # fmt: skip
    # from the folder (its run has no step), then from the trainer's step of other weights
    return results, [main([*argv, "--job.dump_folder", f"{folder}-{run}"]) for run in ("run", "step")]


def test_hugging_face_models_under_cp_and_the_command(dist_pools, tmp_path):
    pytest.importorskip("transformers")
    folders = [(str(_hf_folder(tmp_path / f, f)), s) for f, s in (("qwen3", "ring"), ("gpt_oss", "ulysses"))]
    (tmp_path / "qwen3-prompts.jsonl").write_text(json.dumps({"prompt": "Remember these facts."}) + "\n")
    want = [[r.tokens for r in _hf_generator(f).generate(HF_PROMPTS, NEW, SAMPLING)] for f, _ in folders]
    tokenizer = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(folders[0][0])
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("Remember these facts.", add_special_tokens=False)]
    greedy = []
    for run in ("run", "step"):
        gen = _hf_generator(folders[0][0])
        if run == "step":  # a titan_cp step (the trainer's DCP layout) of other weights
            with torch.no_grad():
                gen.runner.decoder.norm.weight.mul_(-1.5)
            state = get_model_state_dict(gen.runner.model)
            dcp.save({"model": state}, checkpoint_id=str(tmp_path / "qwen3-step" / "checkpoint" / "step-3"))
        greedy.append(gen.generate([prompt], NEW, stop_tokens=[tokenizer.eos_token_id])[0].tokens)
    assert greedy[0] != greedy[1]
    for results, runs in dist_pools.run(2, _hf_under_cp, folders, timeout=600):
        assert results == want  # sampled tokens with a seed: the same on CP 2 as on one process
        for records, tokens in zip(runs, greedy):
            assert records[0]["tokens"] == tokens and records[0]["prompt_tokens"] == len(prompt)


def test_hugging_face_checkpoint_of_another_model_is_named_before_any_process_group(tmp_path):
    pytest.importorskip("transformers")
    qwen3, gpt_oss = _hf_folder(tmp_path / "qwen3", "qwen3"), _hf_folder(tmp_path / "gpt_oss", "gpt_oss")
    (tmp_path / "p.txt").write_text("hello")
    argv = [
        "--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.hf_assets_path", str(qwen3),
        "--checkpoint.initial_load_path", str(gpt_oss), "--job.dump_folder", str(tmp_path / "run"),
        "--parallelism.context_parallel_degree", "1", "--generate.prompt_file", str(tmp_path / "p.txt"),
    ]  # fmt: skip
    with pytest.raises(
        ValueError, match=r"initial_load_path = .*gpt_oss' has no model.layers.0.self_attn.q_norm.weight"
    ):
        prepare(load_config(argv, warn_adjustments=False), 1)
    assert not dist.is_initialized()


# --------------------------------------------------------------------------------------------
# which weights: the run's newest step (a model-only final one too), never another model's


def test_generation_loads_the_newest_step_a_model_only_final_one_too(tmp_path):
    """A folder with step 2 holding the whole state and step 3 the model alone with other weights
    (a model-only final save). Generation loads step 3 (a resume asks which step to take),
    checkpoint.load_step 2 still picks step 2, and the log names the step."""
    from titan_cp.generate.weights import load_generation_weights

    folder = tmp_path / "run" / "checkpoint"
    older, (newest, newest_state) = _tiny_state()[1], _tiny_state()
    torch.manual_seed(1)
    newest_state = {k: torch.randn_like(v) for k, v in newest_state.items()}
    dcp.save({"model": older, "optimizer": {"m": torch.ones(3)}}, checkpoint_id=str(folder / "step-2"))
    dcp.save({"model": newest_state}, checkpoint_id=str(folder / "step-3"))
    (tmp_path / "p.txt").write_text("hello")
    argv = ["--model.flavor", "tiny", "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable",
            "--generate.prompt_file", str(tmp_path / "p.txt")]  # fmt: skip
    job = _prepare(argv)
    assert job.weights.path == folder / "step-3"
    assert job.weights.describe() == f"step 3 of {folder} (steps saved: [2, 3])"
    load_generation_weights(job.weights, newest, job.model)
    for name, value in get_model_state_dict(newest).items():
        torch.testing.assert_close(value, newest_state[name], rtol=0, atol=0)
    assert _prepare([*argv, "--checkpoint.load_step", "2"]).weights.path == folder / "step-2"
    from titan_cp.checkpoint import resume_path

    with pytest.raises(UserError, match="step-3 is the newest step but holds only the model"):
        resume_path(folder)  # it cannot continue step 3, and going back to step 2 is not for it to choose


def test_a_hugging_face_checkpoint_with_tensors_the_model_lacks_is_refused(tmp_path, monkeypatch):
    """A Qwen3 checkpoint (its q_norm / k_norm) through a Llama model.hf_assets_path of the same shapes
    otherwise: refused naming the extra tensors, from the Hugging Face folder and from a titan_cp step."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setitem(HF_FAMILIES, "llama", ("LlamaConfig", dict(head_dim=8, tie_word_embeddings=True)))
    llama, qwen3 = _hf_folder(tmp_path / "llama", "llama"), _hf_folder(tmp_path / "qwen3", "qwen3")
    state = transformers.AutoModelForCausalLM.from_pretrained(str(qwen3)).state_dict()
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "run" / "checkpoint" / "step-4"))
    (tmp_path / "p.txt").write_text("hello")
    argv = [
        "--job.config_file", "train_configs/hf/qwen3_cp.toml", "--model.hf_assets_path", str(llama),
        "--job.dump_folder", str(tmp_path / "run"), "--parallelism.context_parallel_degree", "1",
        "--generate.prompt_file", str(tmp_path / "p.txt"),
    ]  # fmt: skip
    extra = r"holds model.layers.0.self_attn.k_norm.weight, model.layers.0.self_attn.q_norm.weight, .* \(and 1 more\)"
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path}/run/checkpoint/step-4 {extra}, which model.hf_as"):
        prepare(load_config([*argv, "--checkpoint.enable"], warn_adjustments=False), 1)
    from_hf = ["--checkpoint.initial_load_path", str(qwen3), "--checkpoint.initial_load_in_hf",
               "--job.dump_folder", str(tmp_path / "fresh")]  # fmt: skip
    with pytest.raises(ValueError, match=rf"initial_load_path = '{qwen3}' {extra}"):
        prepare(load_config([*argv, *from_hf], warn_adjustments=False), 1)
    assert not dist.is_initialized()


# --------------------------------------------------------------------------------------------
# the main job's questions (generate.task = "lookup"): docs/recall.md's command


def _lookup_argv(tmp_path, *extra):
    """The main job's config as docs/recall.md runs it, on its shipped start (checkpoints/lookup_tiny: no
    step in the fresh dump folder): one held-out document of 2048 tokens (the job's are 8192)."""
    return ["--job.config_file", "train_configs/cpu_main.toml", "--job.dump_folder", str(tmp_path),
            "--generate.lookup_documents", "1", "--validation.seq_len", "2048", *extra]  # fmt: skip


def test_lookup_questions_are_the_validation_rows_prefixes():
    """Each question is the prefix of the trainer's validation row up to the key it asks: the token after
    it is the row's label there, and its distance the row's recall_distance (what validation scores)."""
    from titan_cp.data import ByteTokenizer
    from titan_cp.data.datasets import LOOKUP_KEYS, SyntheticLookup
    from titan_cp.data.packing import Packer
    from titan_cp.generate.lookup import fact_name, lookup_questions

    questions = lookup_questions(ByteTokenizer(), seed=3, tokens=300, documents=2)
    packer = Packer(SyntheticLookup(ByteTokenizer(), seed=3, split="validation", tokens=300), 300)
    rows = [packer.next_row() for _ in range(2)]
    assert [(q.document, q.index) for q in questions] == [(d, j) for d in range(2) for j in range(len(LOOKUP_KEYS))]
    for q in questions:
        row, at = rows[q.document], len(q.prompt) - 1  # the position that predicts the answer
        assert q.prompt == row.tokens[: at + 1].tolist() and q.prompt[-2] == ord("?")
        assert row.labels[at] == q.answer and row.recall_distance[at] == q.distance > 0
        assert fact_name(q.answer).startswith(chr(q.prompt[-1]) + "=")  # the fact of the key asked
    assert sorted(int(d) for row in rows for d in row.recall_distance[row.recall_distance > 0]) == sorted(
        q.distance for q in questions
    )  # every answer the validation scores is asked, once
    assert fact_name(ord(".")) is None


def _run_lookup(rank, world, argv):
    """``main(argv)``'s records, and what this rank printed."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        records = main(argv)
    return records, out.getvalue()


def _lookup_oracle(argv):
    """The shipped model's one-process forward over each held-out row: its argmax at each question."""
    from titan_cp.data import ByteTokenizer
    from titan_cp.families.llama3 import build_model
    from titan_cp.generate.lookup import lookup_questions

    cfg = load_config(argv, training=False)
    model = build_model(cfg.model.flavor, vocab_size=BYTE_VOCAB, device="cpu")
    state = model.state_dict()
    with warnings.catch_warnings():  # DCP's note that it loads in one process, as this oracle means to
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=cfg.checkpoint.initial_load_path, no_dist=True)
    model.load_state_dict(state)
    seq_len = cfg.validation_rows()[1]
    questions = lookup_questions(ByteTokenizer(), cfg.training.seed, seq_len, cfg.generate.lookup_documents)
    with torch.no_grad():
        return [int(model(torch.tensor(q.prompt)[None])[0, -1].argmax()) for q in questions]


def test_the_main_jobs_questions_are_answered_alike_on_1_2_and_4_processes(dist_pools, tmp_path):
    """``python -m titan_cp.generate`` on the main job's config (its [generate] task is "lookup"): on 4
    processes as it is, on 2 and 1 with the cp degree they have (its shard-cut validation, a training key,
    does not stop generation). Every mesh answers each question with the token the one-process model's
    forward ranks first there (what the trainer's validation scores), and prints recall by shards."""
    runs = {world: _lookup_argv(tmp_path / f"cp{world}", *(["--parallelism.context_parallel_degree", str(world)]
                                                           if world != 4 else [])) for world in (4, 2, 1)}  # fmt: skip
    want = _lookup_oracle(runs[1])
    printed = {}
    for world, argv in runs.items():
        by_rank = dist_pools.run(world, _run_lookup, argv, timeout=600)
        records, printed[world] = by_rank[0]
        assert all(r[0] == records for r in by_rank)  # every rank: the same answers
        assert [r["generated_token"] for r in records] == want, world
        assert [json.loads(x) for x in (tmp_path / f"cp{world}" / "lookup.jsonl").read_text().splitlines()] == records
    assert len(records) == 6 and {r["document"] for r in records} == {0}
    assert [r["correct"] for r in records] == [r["generated_token"] == r["answer_token"] for r in records]
    recall = sum(r["correct"] for r in records) / 6
    summary = {w: [line for line in text.splitlines() if line.startswith("recall ")] for w, text in printed.items()}
    assert summary[4][0].startswith(f"recall {recall:.3f} ") and "shards of 512 tokens (cp 4): 0 back" in summary[4][0]
    assert "on another rank" in summary[4][0] and "shards" not in summary[1][0]  # one rank: no shards to count by
    answered = [line for line in printed[1].splitlines() if line.startswith("[document 0, question ")]
    assert len(answered) == 6 and all(line.endswith(("(right)", "(wrong)")) for line in answered)
