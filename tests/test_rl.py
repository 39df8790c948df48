"""Reinforcement learning under context parallelism: per-token log-probs without logits (``cp.token_logprobs``)
and TRL's ``GRPOTrainer`` through ``context_parallel_trainer``.

The oracles: plain fp64 / fp32 softmax over the whole logits (the chunked function); each document alone
through the model's eager attention on one process (the handle's call); the stock ``GRPOTrainer`` on one
process on the same prompts, completions (a fixed ``rollout_func``) and rewards (one step: log-probs,
entropies, the loss of every ``loss_type`` and its gradient). The CP runs: CP 2 (ring) and dp 2 x cp 2
(Ulysses, doc_zigzag); one pool call per world size. Ten steps of ``examples/grpo_agent.py`` at CP 2 against
one process are tests/test_examples.py's.

Tolerances: fp32 sums in another order. Log-probs and entropies (~5) within 1e-5 absolute; a loss within
1e-5 relative (1e-6 absolute: the group advantages sum to 0, so some losses are ~0); each gradient's
largest difference within 1e-5 of its largest entry. The chunked function in fp32 against fp64 within 1e-5.
"""

from __future__ import annotations

import os
import re
import types
import zlib

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
trl = pytest.importorskip("trl", reason="trl is in the trainer extra")
datasets = pytest.importorskip("datasets", reason="datasets is in the dev extra")

from titan_cp.integrations import grpo  # noqa: E402
from titan_cp.integrations.transformers import apply_cp, context_parallel_trainer, tiny_qwen3_folder  # noqa: E402
from titan_cp.loss import IGNORE_INDEX, chunked_token_logprobs  # noqa: E402

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
VARIANTS = [*LOSS_TYPES, "dapo+entropy_mask", "bnpo+entropy_bonus"]
PROMPTS = ["Spell 'ring'.", "Name a strategy of context parallelism, please."]
G = 4  # rollouts per prompt; 8 rows a step
ROWS = [p for p in PROMPTS for _ in range(G)]


# ---- the chunked function ----------------------------------------------------------------------------


def test_chunked_token_logprobs_equal_the_whole_softmax():
    """Log-probs and entropies at a temperature, and both gradients, against the whole logits in fp64;
    -100 rows give 0 and no gradient; chunks of 7 of 53 tokens (the last one short)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(53, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(97, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 97, (53,), generator=g)
    labels[::6] = IGNORE_INDEX
    up = torch.randn(2, 53, generator=g, dtype=torch.float64)
    logp, ent = chunked_token_logprobs(h, w, labels, temperature=0.7, entropy=True, chunk_tokens=7)
    got = torch.autograd.grad((logp.double() * up[0]).sum() + (ent.double() * up[1]).sum(), (h, w))
    z = (h @ w.t() / 0.7).log_softmax(-1)
    valid = labels != IGNORE_INDEX
    want_logp = z.gather(1, labels.clamp(min=0)[:, None])[:, 0].where(valid, 0.0)
    want_ent = -(z.exp() * z).sum(-1).where(valid, 0.0)
    want = torch.autograd.grad((want_logp * up[0]).sum() + (want_ent * up[1]).sum(), (h, w))
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == labels.shape
    assert (logp.double() - want_logp).abs().max() < 1e-5 and (ent.double() - want_ent).abs().max() < 1e-5
    assert logp[~valid].eq(0).all() and ent[~valid].eq(0).all()
    for a, b in zip(got, want):
        assert (a - b).abs().max() / b.abs().max() < 1e-5
    only, none = chunked_token_logprobs(h, w, labels, chunk_tokens=7)
    plain = (h @ w.t()).log_softmax(-1).gather(1, labels.clamp(min=0)[:, None])[:, 0].where(valid, 0.0)
    assert none is None and (only.double() - plain).abs().max() < 1e-5
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        chunked_token_logprobs(h, w, labels, temperature=0.0)


# ---- the handle's call, one process and CP 2 ------------------------------------------------------------

DOC_LENS = [5, 11, 3, 9]


def _documents(vocab: int) -> dict:
    """Four packed documents, targets on all but the first document's first 3 tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab, (1, sum(DOC_LENS)), generator=g)
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX
    positions = torch.cat([torch.arange(n) for n in DOC_LENS])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _each_document_alone(model, batch: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, entropies)`` ``(1, S)`` of each document alone through ``model`` (eager attention):
    at token t, of its own id given the tokens before it in its document; 0 where not a target."""
    logps, ents, start = [], [], 0
    for n in DOC_LENS:
        ids = batch["input_ids"][:, start : start + n]
        z = (model(input_ids=ids, use_cache=False).logits[0].float() / temperature).log_softmax(-1)
        lp, en = torch.zeros(n), torch.zeros(n)
        lp[1:] = z[:-1].gather(1, ids[0, 1:, None])[:, 0]
        en[1:] = -(z.exp() * z).sum(-1)[:-1]
        logps.append(lp)
        ents.append(en)
        start += n
    scored = batch["labels"] != IGNORE_INDEX
    scored[0, torch.tensor([0, *DOC_LENS]).cumsum(0)[:-1]] = False  # a document's first token has no predecessor
    return torch.cat(logps)[None].where(scored, 0.0), torch.cat(ents)[None].where(scored, 0.0)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_token_logprobs_on_one_process_equal_each_document_alone(tmp_path):
    folder = tiny_qwen3_folder(tmp_path)
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="titan_cp")
    cp = apply_cp(model, None)
    batch = _documents(eager.config.vocab_size)
    out = cp.token_logprobs(model, batch, temperature=0.8, entropy=True, gather=True)
    want_lp, want_ent = _each_document_alone(eager, batch, 0.8)
    assert (out.logprobs - want_lp).abs().max() < 1e-5 and (out.entropy - want_ent).abs().max() < 1e-5
    assert torch.equal(out.labels, batch["input_ids"].where(want_lp != 0, IGNORE_INDEX))
    (out.logprobs.sum() + out.entropy.sum()).backward()
    (want_lp.sum() + want_ent.sum()).backward()
    assert (_grads(model) - _grads(eager)).abs().max() / _grads(eager).abs().max() < 1e-5
    local = cp.token_logprobs(
        model, cp.shard(batch), temperature=0.8
    )  # a sharded batch in, this rank's (here every) token out
    assert local.entropy is None and torch.equal(local.labels[:, :-1].ne(IGNORE_INDEX), want_lp[:, 1:].ne(0))
    assert (local.logprobs[:, :-1] - want_lp[:, 1:]).abs().max() < 1e-5
    with pytest.raises(ValueError, match=r"token_logprobs needs the tokens to score: give the batch labels"):
        cp.token_logprobs(model, {k: v for k, v in batch.items() if k != "labels"})


def _handle_under_cp2(rank: int, world: int, folder: str) -> dict:
    """``cp.token_logprobs`` at CP 2 (ring, doc_zigzag) against each document alone on one process: the
    gathered form (log-probs, entropies; the same loss on both ranks, whose gradients summed are twice
    one process's) and the local form (each token on one rank: summed over the ranks, one process's)."""
    from tests.dist_utils import get_mesh  # noqa: PLC0415

    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="titan_cp")
    cp = apply_cp(model, get_mesh((2,), ("cp",)), strategy="ring", balance="doc_zigzag")
    batch = _documents(eager.config.vocab_size)
    want_lp, want_ent = _each_document_alone(eager, batch, 0.8)
    (want_lp.sum() + want_ent.sum()).backward()
    want_both = _grads(eager).clone()
    eager.zero_grad()
    _each_document_alone(eager, batch, 0.8)[0].sum().backward()
    want_logp = _grads(eager)

    out = cp.token_logprobs(model, batch, temperature=0.8, entropy=True, gather=True)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    both = _grads(model).clone()
    model.zero_grad()
    local = cp.token_logprobs(model, batch, temperature=0.8)
    local.logprobs.sum().backward()
    logp, total = _grads(model), local.logprobs.sum().detach()
    for t in (both, logp, total):
        torch.distributed.all_reduce(t)
    return {
        "logprobs": float((out.logprobs - want_lp).abs().max()),
        "entropy": float((out.entropy - want_ent).abs().max()),
        "grad": float((both / world - want_both).abs().max() / want_both.abs().max()),
        "local_sum": float(total - want_lp.sum()),
        "local_grad": float((logp - want_logp).abs().max() / want_logp.abs().max()),
        "local_shape": tuple(local.logprobs.shape),
    }


# ---- one GRPO step: CP 2 and dp 2 x cp 2 against the stock GRPOTrainer on one process -----------------------


def _completion(prompt: str, k: int) -> list[int]:
    """The ``k``-th rollout of ``prompt``: 3 to 13 ids, fixed (crc32, the same in every process)."""
    g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()) + 101 * k)
    return torch.randint(2, 250, (3 + (zlib.crc32(prompt.encode()) + 7 * k) % 11,), generator=g).tolist()


def _fixed_rollouts(prompts: list, trainer) -> dict:
    """TRL's ``rollout_func``: each prompt's next fixed completion (counting its repeats in this call)."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        seen[p] = seen.get(p, -1) + 1
        out.append(_completion(p, seen[p]))
    ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
    return {"prompt_ids": ids, "completion_ids": out, "logprobs": None}


def _reward(completions: list, **_) -> list[float]:
    return [len(set(c)) / 10 + c.count("e") for c in completions]


def _two_e(completions: list, **_) -> list[float]:
    """A coarse reward: some groups' rollouts all score alike (TRL's ``frac_reward_zero_std``)."""
    return [float(c.count("e") > 1) for c in completions]


def _scored_rows(tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The step's 8 rows as TRL lays them out: prompts padded on the left, completions on the right."""
    prompts = [tokenizer(p)["input_ids"] for p in ROWS]
    completions = [_completion(p, i % G) for i, p in enumerate(ROWS)]
    P, C = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(ROWS), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, P - len(p) : P + len(c)] = torch.tensor(p + c)
        mask[r, P - len(p) : P + len(c)] = 1
    return ids, mask, C


def _env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"


def _trainer(rank: int, world: int, folder: str, out: str, cp: int, **factory) -> object:
    """The stock GRPOTrainer (``cp`` 0, eager attention) or the factory's; 8 rollouts a step over the dp ranks,
    two iterations a generation (old log-probs) and a KL term (the reference model)."""
    _env(rank, world)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="titan_cp" if cp else "eager")
    dp = world // max(cp, 1)
    args = trl.GRPOConfig(
        output_dir=f"{out}/grpo-{world}-{cp}", per_device_train_batch_size=len(ROWS) // dp, num_generations=G,
        max_completion_length=16, num_iterations=2, beta=0.04, use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
        gradient_checkpointing=False, bf16=False,  # fp32 (TRL defaults to bf16 autocast)
    )  # fmt: skip
    cls = context_parallel_trainer(trl.GRPOTrainer, cp_size=cp, **factory) if cp else trl.GRPOTrainer
    data = datasets.Dataset.from_dict({"prompt": PROMPTS})
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    trainer = cls(
        model=model, reward_funcs=_reward, args=args, train_dataset=data, processing_class=tokenizer,
        rollout_func=_fixed_rollouts,
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # what the Trainer's loop sets
    return trainer


def _variant(trainer, name: str) -> None:
    """``loss_type``, and for two variants TRL's high-entropy token mask or its entropy bonus."""
    trainer.loss_type = name.split("+")[0]
    trainer.top_entropy_quantile = 0.5 if name.endswith("entropy_mask") else 1.0
    trainer.entropy_coef = 0.05 if name.endswith("entropy_bonus") else 0.0
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0


def _grpo_step(rank: int, world: int, folder: str, out: str, cp: int, factory: dict) -> dict:
    """One GRPO step's inputs (rollouts, rewards, old and reference log-probs) for this rank's dp share of
    the 8 rows; then each variant's loss and gradient as DDP would give them (averaged over the world)."""
    trainer = _trainer(rank, world, folder, out, cp, **factory)
    dp = world // max(cp, 1)
    mine = slice((rank // max(cp, 1)) * len(ROWS) // dp, (rank // max(cp, 1) + 1) * len(ROWS) // dp)
    model = trainer.model.train()
    inputs = trainer._prepare_inputs([{"prompt": p} for p in ROWS[mine]])
    ids, mask, keep = _scored_rows(trainer.processing_class)
    logps, ents, _ = trainer._get_per_token_logps_and_entropies(
        model, ids[mine], mask[mine], keep, compute_entropy=True
    )
    result = {"logps": logps.detach(), "entropy": ents.detach(), "rewards": trainer._metrics["train"]["reward"][-1]}
    for name in VARIANTS:
        _variant(trainer, name)
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        both = torch.cat([loss.detach().reshape(1), _grads(model)])
        if world > 1:
            torch.distributed.all_reduce(both)
            both /= world
        result[name] = both
    return result


def _per_rank_rollouts(prompts: list, trainer) -> dict:
    return {**_fixed_rollouts(prompts, trainer), "completion_ids": [[2 + torch.distributed.get_rank()]] * len(prompts)}


def _per_rank_reward(completions: list, **_) -> list[float]:
    return [float(torch.distributed.get_rank())] * len(completions)


def _cp_refusals(rank: int, world: int, folder: str, out: str) -> list[str]:
    """Under CP 2: a rollout_func that samples per process, and a reward that answers each process
    differently, are refused on every rank (each rank sees both copies)."""
    trainer = _trainer(rank, world, folder, out, 2)
    found = []
    for rollouts, reward in ((_per_rank_rollouts, _reward), (_fixed_rollouts, _per_rank_reward)):
        trainer.rollout_func, trainer.reward_funcs, trainer.reward_func_names = rollouts, [reward], [reward.__name__]
        try:
            trainer._prepare_inputs([{"prompt": p} for p in ROWS])
            found.append("")
        except ValueError as e:
            found.append(str(e))
    return found


def _train(rank: int, world: int, folder: str, out: str, cp: int) -> list[tuple[float, ...]]:
    """Two steps of the factory's GRPOTrainer at ``cp`` without a rollout_func: TRL tokenizes the prompts,
    titan_cp generates under the CP layout. Per step: loss, grad norm, the rewards' mean, tokens seen,
    the share of groups whose rewards are all equal, the rewards' std."""
    import titan_cp.generate  # noqa: F401, PLC0415 - registers titan_cp's rollouts

    _env(rank, world)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="titan_cp")
    args = trl.GRPOConfig(
        output_dir=f"{out}/train-{world}", per_device_train_batch_size=len(ROWS), num_generations=G,
        max_completion_length=8, max_steps=2, learning_rate=1e-2, logging_steps=1, use_cpu=True, report_to=[],
        seed=0, disable_tqdm=True, bf16=False, save_strategy="no",
    )  # fmt: skip
    trainer = context_parallel_trainer(trl.GRPOTrainer, cp_size=cp)(
        model=model, reward_funcs=_two_e, args=args, train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=transformers.AutoTokenizer.from_pretrained(folder),
    )  # fmt: skip
    trainer.train()
    keys = ("loss", "grad_norm", "reward", "num_tokens", "frac_reward_zero_std", "reward_std")
    return [tuple(r[k] for k in keys) for r in trainer.state.log_history if "loss" in r]


def _all_one(rank: int, world: int, folder: str, out: str) -> dict:
    return {"step": _grpo_step(rank, world, folder, out, 0, {}), "train": _train(rank, world, folder, out, 1)}


def _all_cp2(rank: int, world: int, folder: str, out: str) -> dict:
    return {
        "handle": _handle_under_cp2(rank, world, folder),
        "step": _grpo_step(rank, world, folder, out, 2, {"strategy": "ring"}),
        "train": _train(rank, world, folder, out, 2),
        "refused": _cp_refusals(rank, world, folder, out),
    }


def _close(got: dict, want: dict, rows: slice, name: str) -> None:
    assert (got["logps"] - want["logps"][rows]).abs().max() < 1e-5, name
    assert (got["entropy"] - want["entropy"][rows]).abs().max() < 1e-5, name
    for v in VARIANTS:
        loss, grad = got[v][0], got[v][1:]
        ref_loss, ref_grad = want[v][0], want[v][1:]
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-6), (name, v)
        assert float((grad - ref_grad).abs().max() / ref_grad.abs().max()) < 1e-5, (name, v)


def test_one_grpo_step_under_cp_equals_the_stock_trainer_on_one_process(dist_pools, tmp_path):
    folder = str(tiny_qwen3_folder(tmp_path / "qwen3"))
    out = str(tmp_path)
    one = dist_pools.run(1, _all_one, folder, out)[0]
    want = one["step"]
    cp2 = dist_pools.run(2, _all_cp2, folder, out, timeout=600)
    dp2 = dist_pools.run(4, _grpo_step, folder, out, 2, {"strategy": "ulysses", "balance": "doc_zigzag"}, timeout=600)
    for r in cp2:
        handle = r["handle"]
        assert handle["logprobs"] < 1e-5 and handle["entropy"] < 1e-5, handle
        assert handle["grad"] < 1e-5 and handle["local_grad"] < 1e-5 and abs(handle["local_sum"]) < 1e-4, handle
        assert handle["local_shape"] == (1, sum(DOC_LENS) // 2), handle
        _close(r["step"], want, slice(None), "cp 2")
        steps, one_steps = r["train"], one["train"]
        assert len(steps) == len(one_steps) == 2 and [x[2:5] for x in steps] == [x[2:5] for x in one_steps], steps
        assert [x[5] for x in steps] == pytest.approx([x[5] for x in one_steps], rel=1e-6), steps
        assert [x[0] for x in steps] == pytest.approx([x[0] for x in one_steps], rel=1e-5, abs=1e-6), steps
        assert [x[1] for x in steps] == pytest.approx([x[1] for x in one_steps], rel=1e-5), steps
        rollouts, rewards = r["refused"]
        assert "ranks of a cp group generated different completions" in rollouts and "cp_generate" in rollouts
        assert "reward function '_per_rank_reward' gave the 2 ranks of a cp group different rewards" in rewards
    for rank, r in enumerate(dp2):
        _close(r, want, slice((rank // 2) * 4, (rank // 2 + 1) * 4), f"dp 2 x cp 2, rank {rank}")
        assert torch.equal(r["bnpo"], dp2[0]["bnpo"])  # the step's loss and gradient: the same on every rank


# ---- memory: a 16K-token row, a 128K vocabulary, CP 2 ---------------------------------------------------


def test_token_logprobs_of_a_16k_row_with_a_128k_vocabulary_peak_under_a_tenth_of_the_logits():
    """Counted, not timed: rank 0 of CP 2 (ring) on PyTorch's fake process group, every tensor a fake one
    (shapes, no arithmetic), every storage an operation creates and its release recorded
    (``benchmarks.full_step.LiveBytes``); the host-side bookkeeping of the layout (small integer tensors on
    real data) runs for real and is counted too. The peak of what the call creates, without and with the
    backward, against the 16,384 x 128,256 fp32 logits of the row (8.4 GB): at most a tenth. The same
    counter sees the model's own logits of this rank's tokens (half the row's) when they are made."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    from benchmarks.full_step import fake_world  # noqa: PLC0415

    vocab, seq = 128256, 16384
    logits = seq * vocab * 4
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=seq, tie_word_embeddings=True,
    )  # fmt: skip
    lens = [4096, 6000, 2288, 4000]
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.cat([torch.arange(n) for n in lens])[None]}
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="titan_cp")
        cp = apply_cp(model, mesh, strategy="ring")
        local = cp.shard(batch)  # on the host, before counting
        peaks = [_counted(lambda: cp.token_logprobs(model, local, entropy=True), grad) for grad in (False, True)]
        whole = _counted(lambda: model(**{k: v for k, v in local.items() if "labels" not in k}), False)
    assert local["input_ids"].shape == (1, seq // 2)
    assert max(peaks) <= 0.1 * logits, [p / logits for p in peaks]
    assert whole >= logits // 2  # the counter sees logits when they exist


def _counted(call, grad: bool) -> int:
    """Peak bytes of the storages ``call`` (and, with ``grad``, the backward of its log-probs and entropies)
    creates, on fake tensors (the test above)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: PLC0415
    from torch.utils._python_dispatch import _disable_current_modes  # noqa: PLC0415
    from torch.utils._pytree import tree_leaves  # noqa: PLC0415

    from benchmarks.full_step import LiveBytes  # noqa: PLC0415

    class HostReal(LiveBytes):
        """LiveBytes, with ops on real tensors only (the layout's host integers) run for real."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if not given or any(isinstance(t, FakeTensor) for t in given):
                return super().__torch_dispatch__(func, types, args, kwargs)
            with _disable_current_modes():
                out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t)
            return out

    tracker = HostReal()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker, torch.set_grad_enabled(grad):
        tracker.mark("call")
        out = call()
        if grad:
            (out.logprobs.sum() + out.entropy.sum()).backward()
        del out
    return tracker.timeline("call")["device_peak_bytes"]


# ---- what is refused, naming the fix ----------------------------------------------------------------------


def _refused(folder: str, tmp, **fields) -> str:
    """The message the factory's GRPOTrainer at CP 1 raises for ``GRPOConfig(**fields)``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="titan_cp")
    fields = {"per_device_train_batch_size": 4, "num_generations": 4, **fields}
    args = trl.GRPOConfig(output_dir=str(tmp), use_cpu=True, report_to=[], **fields)
    cls = context_parallel_trainer(trl.GRPOTrainer, cp_size=1)
    data = datasets.Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ValueError) as e:
        cls(model=model, reward_funcs=_reward, args=args, train_dataset=data)
    return str(e.value)


def test_misuse_of_grpo_under_cp_is_refused_naming_the_fix(tmp_path, monkeypatch):
    import titan_cp.generate  # noqa: F401, PLC0415 - registers titan_cp's rollouts

    folder = str(tiny_qwen3_folder(tmp_path / "qwen3"))
    for fields, message in [
        (dict(use_vllm=True), r"use_vllm=True \(vllm_mode='colocate'\): every cp rank would ask vLLM .* set use_vllm=False"),
        (dict(use_transformers_continuous_batching=True), r"paged generation cannot run a model bound to the CP"),
        (dict(eval_strategy="steps", eval_steps=1), r"eval_strategy=.*evaluation is not built under CP; set eval_strategy='no'"),
        (dict(cast_lm_head_to_fp32=True), r"cast_lm_head_to_fp32=True: .* set it to False"),
        (dict(top_k=5), r"top_k=5: titan_cp's sampler draws with temperature and top_p only; unset it"),
        (dict(generation_kwargs={"top_k": 5}), r"generation_kwargs=\{'top_k': 5\}: titan_cp's sampler takes none"),
    ]:  # fmt: skip
        assert re.search(message, _refused(folder, tmp_path, **fields)), fields
    monkeypatch.setattr(grpo, "_ROLLOUTS", [])
    assert "import titan_cp.generate (it registers it), or pass rollout_func=" in _refused(folder, tmp_path)
    for kwargs in (dict(fsdp=True), dict(chunked_loss=True)):
        with pytest.raises(ValueError, match=r"GRPO computes its log-probs chunked .* drop chunked_loss and fsdp"):
            context_parallel_trainer(trl.GRPOTrainer, cp_size=2, **kwargs)

    class Renamed(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids):  # a TRL release that changed the hook
            raise AssertionError

    with pytest.raises(
        ValueError, match=r"relies on Renamed._generate_single_turn\(prompt_ids, images, .* of trl 1.16"
    ):
        context_parallel_trainer(Renamed, cp_size=2)
    # dp 2 x cp 2: 2 rollouts per dp rank would split a group of 4 across dp ranks
    args = types.SimpleNamespace(per_device_train_batch_size=1, steps_per_generation=2, num_generations=4)
    (found,) = grpo._batch_refusals(args, cp=2, dp=2)
    assert "2 rollouts per dp rank split groups of num_generations = 4 across dp ranks" in found
    assert args.generation_batch_size == 4  # counts dp ranks, not processes
    args.per_device_train_batch_size, args.steps_per_generation = 3, 1  # TRL counted 3 x 4 processes = 12: fine
    (found,) = grpo._batch_refusals(args, cp=2, dp=2)
    assert "= 3 x 2 is not a multiple of num_generations = 4 (under CP a cp group is one process)" in found


def test_rewards_gathered_over_a_cp_group_count_each_rollout_once():
    """TRL's gather over 4 processes (dp 2 x cp 2, 3 rollouts each): this rank (cp rank 1) keeps its own
    copies, NaN elsewhere; copies that differ name the reward function."""
    host = types.SimpleNamespace(dp_size=2, cp_size=2, _cp_index=1, reward_func_names=["length", "letters"])
    rows = torch.arange(12.0).view(2, 1, 3, 2).expand(2, 2, 3, 2).reshape(12, 2)  # each dp rank's rows twice
    own = grpo.GRPOMixin._cp_own_copies(host, rows, 3)
    assert torch.equal(own.view(2, 2, 3, 2)[:, 1], rows.view(2, 2, 3, 2)[:, 1])
    assert own.view(2, 2, 3, 2)[:, 0].isnan().all()
    rows = rows.clone()
    rows[7, 1] += 1  # dp rank 1, cp rank 0, its second rollout, the second function
    with pytest.raises(ValueError, match=r"reward function 'letters' gave the 2 ranks of a cp group different rewards"):
        grpo.GRPOMixin._cp_own_copies(host, rows, 3)
