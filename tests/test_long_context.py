"""The long-context memory options against the same runs without them: checkpointed inputs on the
host (``activation_checkpoint.cpu_offload``), k-block checkpoint units (``blocks_per_checkpoint``),
the tiled feed-forward (``tile_tokens``) and FSDP's CPU offload (``training.enable_cpu_offload``).

Offload and k-block units change where inputs are kept and what is recomputed, never an
arithmetic operation: losses and gradients are asserted bit-identical. Tiles compute each token's
feed-forward from the same numbers, but the weight gradients are sums over tiles (another order of
the same additions) and a matmul over fewer rows may be blocked differently: fp32, the tiny model's
gradients move by ~1e-7 absolute; asserted within rtol 1e-5 / atol 1e-6 (losses, gradients and
the parameters after an AdamW step).
"""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_composition import SEED, _clean, _full, local_microbatch, make_batch
from titan_cp.ac_modes import AC_MODES, ac_mode_and_every
from titan_cp.config import load_config
from titan_cp.families.llama3 import LlamaBuilder, build_model, materialize, model_args
from titan_cp.loss import IGNORE_INDEX, GlobalTokenLoss
from titan_cp.mesh import ParallelDims
from titan_cp.parallel.ac import apply_ac, check_ac
from titan_cp.parallel.build import ParallelizeOptions, build_parallel_model
from titan_cp.parallel.tiled_mlp import apply_tiled_mlp, check_tile_tokens
from titan_cp.parallel.units import unit_blocks
from titan_cp.step import forward_backward

OPTIONS = dict(ac_cpu_offload=True, ac_blocks_per_checkpoint=2)


WIDE = dict(multiple_of=100)  # feed-forward 200 wide: no other tensor of the step is


def _single(n_layers: int, tile: int = 0, mode: str = "full", **ac):
    """Loss, gradients and the store of one step of the tiny model under AC ``mode`` with ``ac``."""
    model = build_model("tiny", n_layers=n_layers, **WIDE)
    materialize(model, "cpu", SEED)
    apply_tiled_mlp(model, tile)
    store = apply_ac(model, mode, **ac)
    mb = make_batch(0)
    loss = model(mb.tokens, mb.positions, mb.doc_lens, mb.labels)
    loss.backward()
    return loss.detach(), {_clean(n): p.grad for n, p in model.named_parameters()}, store


@pytest.mark.parametrize("n_layers,prefetch", [(2, 1), (6, 1), (6, 2)])
def test_offloaded_inputs_are_bounded_on_the_device_and_exact(n_layers, prefetch):
    """During the backward at most ``prefetch + 1`` units' inputs are alive outside the host store,
    whatever the depth; one host copy per unit (plus the RoPE tables, stored once); all freed after."""
    want_loss, want_grads, _ = _single(n_layers)
    for k in (1, 2):
        loss, grads, store = _single(n_layers, cpu_offload=True, blocks_per_checkpoint=k, prefetch=prefetch)
        units = -(-n_layers // k)
        assert store.max_device_inputs == min(prefetch + 1, units + 1), (store.max_device_inputs, prefetch, units)
        # a unit's input each, the head's (final norm and loss, one more unit), cos and sin once
        assert store.stored == units + 3 and store.fetched == units + 3
        assert store.host_bytes == 0 and store.peak_host_bytes > 0
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)


class _WidestFeedForward(TorchDispatchMode):
    """The most tokens of a SiLU (or its backward) over the feed-forward's ``hidden``-wide intermediates,
    forward, recomputation and backward."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.rows = hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.silu.default, torch.ops.aten.silu_backward.default):
            assert out.shape[-1] == self.hidden
            self.rows = max(self.rows, out.shape[:-1].numel())
        return out


class _LiveFeedForwards(TorchDispatchMode):
    """Counts the feed-forward's SiLU outputs (saved for its backward, one per block's forward or
    recomputation): ``calls`` in all, ``most_alive`` the most alive at once."""

    def __init__(self):
        super().__init__()
        self.alive, self.calls, self.most_alive = [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.silu.default:
            self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(out)]
            self.calls += 1
            self.most_alive = max(self.most_alive, len(self.alive))
        return out


@pytest.mark.parametrize("mode,k", [("full", 2), ("full", 3), ("op", 2)])
def test_k_block_units_recompute_one_block_at_a_time_and_match(mode, k, n_layers=5):
    """A k-block unit's recomputation keeps only its blocks' inputs: each block's internals are
    recomputed by the block's own checkpoint, one block alive at a time, for k - 1 more block
    forwards per unit of k; losses and gradients bit-identical to per-block checkpointing."""
    want_loss, want_grads, _ = _single(n_layers, mode=mode)
    with _LiveFeedForwards() as probe:
        loss, grads, _ = _single(n_layers, mode=mode, blocks_per_checkpoint=k)
    sizes = [len(u) for u in unit_blocks(n_layers, "full", 1, k)]
    assert probe.calls == n_layers + sum(2 * s - 1 for s in sizes), (probe.calls, sizes)
    assert probe.most_alive == 1, probe.most_alive
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)


def test_tiled_feed_forward_holds_one_tile_and_matches():
    args = model_args("tiny", n_layers=2, **WIDE)
    want_loss, want_grads, _ = _single(2)
    for tile in (0, 16):
        with _WidestFeedForward(args.ffn_hidden_dim) as probe:
            loss, grads, _ = _single(2, tile=tile)
        assert probe.rows == (16 if tile else make_batch(0).tokens.numel()), probe.rows
    assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for n, want in want_grads.items():
        torch.testing.assert_close(grads[n], want, rtol=1e-5, atol=1e-6)


def test_bad_options_name_the_key():
    model = build_model("tiny", n_layers=2)
    with pytest.raises(ValueError, match="blocks_per_checkpoint"):
        apply_ac(model, "full", blocks_per_checkpoint=0)
    with pytest.raises(ValueError, match="blocks_per_checkpoint"):
        apply_ac(model, "selective", every=2, blocks_per_checkpoint=2)
    with pytest.raises(ValueError, match="tile_tokens"):
        apply_tiled_mlp(model, -1)
    with pytest.raises(ValueError, match="activation_checkpoint.cpu_offload"):
        load_config(["--activation_checkpoint.mode", "none", "--activation_checkpoint.cpu_offload", "true"])
    with pytest.raises(ValueError, match="enable_cpu_offload"):
        load_config(["--training.enable_cpu_offload", "true"] + [f"--parallelism.{k}=1" for k in _DEGREES])


_DEGREES = ("data_parallel_shard_degree", "context_parallel_degree", "data_parallel_replicate_degree")


# ---- CP 2, FSDP 2 x CP 2, PP 2 x CP 2 ----------------------------------------------------------------


def _run(world, combo: dict, **extra):
    pd = ParallelDims(
        dp_shard=combo.get("dp_shard", 1), cp=combo["cp"], pp=combo.get("pp", 1), tp=1, dp_replicate=1, world_size=world
    )
    pd.build_mesh("cpu")
    options = ParallelizeOptions(cp_strategy="ring", cp_balance="doc_zigzag", ac_mode="full", **extra)
    loss_fn = GlobalTokenLoss()
    args = model_args("tiny", n_layers=4)
    built = build_parallel_model(LlamaBuilder(args), pd, options, "cpu", seed=SEED, loss_fn=loss_fn, pp_microbatches=2)
    opt = torch.optim.AdamW([p for part in built.parts for p in part.parameters()], lr=1e-3)
    losses = []
    for step in range(1):  # the loss, and the parameters after an AdamW step (they carry the gradients)
        full = make_batch(step)
        loss_fn.global_valid_tokens = int((full.labels != IGNORE_INDEX).sum())
        mb = local_microbatch(pd, built, full)
        loss = forward_backward(built.parts, mb, loss_fn, built.schedule, built.has_first, built.has_last)
        counted = loss.detach() if built.has_last else torch.zeros(())
        dist.all_reduce(counted)
        losses.append(counted)
        opt.step()
        opt.zero_grad()
    params = {_clean(n): _full(p.detach()) for part in built.parts for n, p in part.named_parameters()}
    return losses, params


def _compare(rank, world, combo):
    plain = _run(world, combo)
    offloaded = _run(world, combo, **OPTIONS, fsdp_cpu_offload=combo.get("dp_shard", 1) > 1)
    tiled = _run(world, combo, **OPTIONS, tile_tokens=8)
    exact = all(torch.equal(a, b) for a, b in zip(plain[0], offloaded[0])) and all(
        torch.equal(plain[1][n], offloaded[1][n]) for n in plain[1]
    )
    loss_err = max((a - b).abs().item() for a, b in zip(plain[0], tiled[0]))
    param_err = max(((plain[1][n] - tiled[1][n]).abs() - 1e-5 * plain[1][n].abs()).max().item() for n in plain[1])
    return exact, loss_err, param_err


@pytest.mark.parametrize(
    "world,combo",
    [(2, dict(cp=2)), (4, dict(dp_shard=2, cp=2)), (4, dict(pp=2, cp=2))],
    ids=["cp2", "fsdp2_cp2", "pp2_cp2"],
)
def test_options_keep_the_losses_of_parallel_runs(dist_pools, world, combo):
    for exact, loss_err, param_err in dist_pools.run(world, _compare, combo, timeout=600):
        assert exact
        assert loss_err <= 1e-5 and param_err <= 1e-6, (loss_err, param_err)


# ---- every combination: mode x offload x units x tiles, then the mesh axes -----------------------------------

# ``[activation_checkpoint]`` mode and selective_ac_option (none / full / layer-level every 1 and 2 / op-level)
AC_KEYS = [("none", "2"), ("full", "2"), ("selective", "1"), ("selective", "2"), ("selective", "op")]


def _refusal(mode: str, option: str, offload: bool, k: int) -> str | None:
    """The key a combination is refused for before start, or None: offload needs a checkpoint, and k-block units
    full or op-level checkpoints (``ActivationCheckpoint.check``)."""
    if offload and mode == "none":
        return "activation_checkpoint.cpu_offload"
    if k > 1 and not (mode == "full" or option == "op"):
        return "activation_checkpoint.blocks_per_checkpoint"
    return None


def _accepted():
    """Every combination the config accepts, as ``ParallelizeOptions`` keywords (as the trainer maps them)."""
    for (mode, option), offload, k, tile in itertools.product(AC_KEYS, (False, True), (1, 2), (0, 8)):
        if _refusal(mode, option, offload, k) is None:
            ac_mode, every = ac_mode_and_every(mode, option)
            yield dict(
                ac_mode=ac_mode, ac_every=every, ac_cpu_offload=offload, ac_blocks_per_checkpoint=k, tile_tokens=tile
            )


def _step(world, combo: dict, options: dict):
    """The loss and full gradients of one step of the tiny model (3 blocks: a 2-block unit and a 1-block one) on
    ``combo``'s mesh. FSDP casts its inputs (``mp_param_dtype`` set, float32 here as bf16 on a GPU): its hooks run
    record_function regions and casts, in the forward and in the recomputations."""
    pd = ParallelDims(
        dp_shard=combo.get("dp_shard", 1), cp=combo["cp"], pp=combo.get("pp", 1), tp=1, dp_replicate=1, world_size=world
    )
    pd.build_mesh("cpu")
    parallelize = ParallelizeOptions(
        cp_strategy="ring", cp_balance="doc_zigzag", mp_param_dtype=torch.float32, **options
    )
    loss_fn = GlobalTokenLoss()
    args = model_args("tiny", n_layers=combo.get("n_layers", 3))
    built = build_parallel_model(
        LlamaBuilder(args), pd, parallelize, "cpu", seed=SEED, loss_fn=loss_fn, pp_microbatches=2
    )
    full = make_batch(0)
    loss_fn.global_valid_tokens = int((full.labels != IGNORE_INDEX).sum())
    mb = local_microbatch(pd, built, full)
    loss = forward_backward(built.parts, mb, loss_fn, built.schedule, built.has_first, built.has_last)
    counted = loss.detach() if built.has_last else torch.zeros(())
    dist.all_reduce(counted)
    return counted, {_clean(n): _full(p.grad) for part in built.parts for n, p in part.named_parameters()}


def _against_plain(rank, world, combo, combinations):
    """Per combination: whether its loss and gradients equal the run without any option bit for bit, the loss's
    difference, and the gradients' largest beyond rtol 1e-5."""
    want_loss, want = _step(world, combo, dict(ac_mode="none"))
    out = []
    for options in combinations:
        loss, grads = _step(world, combo, options)
        exact = torch.equal(loss, want_loss) and all(torch.equal(grads[n], want[n]) for n in want)
        grad_err = max(((grads[n] - want[n]).abs() - 1e-5 * want[n].abs()).max().item() for n in want)
        out.append((options, exact, (loss - want_loss).abs().item(), grad_err))
    return out


def _check_against_plain(results) -> None:
    for options, exact, loss_err, grad_err in results:
        if options["tile_tokens"]:  # the module docstring's tolerance
            assert loss_err <= 1e-5 and grad_err <= 1e-6, (options, loss_err, grad_err)
        else:
            assert exact, (options, loss_err, grad_err)


def test_every_memory_option_combination_equals_the_plain_run(dist_pools):
    """Every accepted mode x cpu_offload x blocks_per_checkpoint x tile_tokens, on CP 2 with FSDP over the cp ranks,
    against the run without them. Op-level units (offload, or k > 1) failed in the backward: the selective
    checkpoint's recomputation met FSDP's hooks' ops, which its forward had run elsewhere or not at all."""
    combinations = list(_accepted())
    assert len(combinations) == 26
    for results in dist_pools.run(2, _against_plain, dict(cp=2), combinations, timeout=600):
        assert [r[0] for r in results] == combinations
        _check_against_plain(results)


# op-level checkpoints offloaded in 2-block units, with and without tiles; layer-level every 2nd block offloaded
# (full 2-block units: test_options_keep_the_losses_of_parallel_runs)
REPRESENTATIVE = [
    dict(ac_mode="op", ac_cpu_offload=True, ac_blocks_per_checkpoint=2, tile_tokens=0),
    dict(ac_mode="op", ac_cpu_offload=True, ac_blocks_per_checkpoint=2, tile_tokens=8),
    dict(ac_mode="selective", ac_every=2, ac_cpu_offload=True, tile_tokens=0),
]


@pytest.mark.parametrize(
    "combo",
    [dict(cp=4), dict(dp_shard=2, cp=2), dict(pp=2, cp=2, n_layers=4)],
    ids=["cp4", "fsdp2_cp2", "pp2_cp2"],
)
def test_memory_options_on_other_meshes_equal_the_plain_run(dist_pools, combo):
    for results in dist_pools.run(4, _against_plain, combo, REPRESENTATIVE, timeout=600):
        _check_against_plain(results)


def test_every_combination_validates_or_is_refused_in_one_line_before_start():
    """Mode x offload x units x tiles x CP size x FSDP x PP, through ``load_config`` alone (no process group): each
    combination either validates, and the builder's own checks then take what the trainer makes of it, or is refused
    with one line naming the key; only the combinations the options cannot mean are refused."""
    meshes = itertools.product((1, 2, 4), (1, 2), (1, 2))  # cp, dp_shard, pp
    for (cp, dp_shard, pp), (mode, option), offload, k, tile in itertools.product(
        meshes, AC_KEYS, (False, True), (1, 2), (0, 8)
    ):
        argv = [
            "--model.flavor", "tiny",
            "--training.seq_len", "256",
            "--training.local_batch_size", "2",
            "--parallelism.context_parallel_degree", str(cp),
            "--parallelism.data_parallel_shard_degree", str(dp_shard),
            "--parallelism.pipeline_parallel_degree", str(pp),
            "--activation_checkpoint.mode", mode,
            "--activation_checkpoint.selective_ac_option", option,
            "--activation_checkpoint.cpu_offload", str(offload).lower(),
            "--activation_checkpoint.blocks_per_checkpoint", str(k),
            "--activation_checkpoint.tile_tokens", str(tile),
        ]  # fmt: skip
        refused = _refusal(mode, option, offload, k)
        try:
            cfg = load_config(argv)
        except ValueError as e:
            assert refused is not None and refused in str(e) and "\n" not in str(e), (argv, str(e))
            continue
        assert refused is None, argv
        ac = cfg.activation_checkpoint
        ac_mode, every = ac_mode_and_every(ac.mode, ac.selective_ac_option)
        assert ac_mode in AC_MODES
        check_ac(ac_mode, every, ac.cpu_offload, ac.blocks_per_checkpoint)
        check_tile_tokens(ac.tile_tokens)


# ---- a Hugging Face model -------------------------------------------------------------------------


def _hf_step(family: str, tile: int = 0, **ac):
    from tests.test_hf_integration import hf_model, packed_batch  # noqa: PLC0415 - needs transformers
    from titan_cp.integrations.transformers import CausalLM, apply_ac, apply_cp, apply_tiled_mlp  # noqa: PLC0415

    model = hf_model(family, attn="titan_cp")
    cp = apply_cp(model, None)
    lm = CausalLM(model)
    apply_tiled_mlp(lm, tile)
    store = apply_ac(lm, "full", **ac)
    local = cp.shard(packed_batch())
    loss = lm(local["input_ids"], local["position_ids"], local["cp_doc_lens"], local["shift_labels"])
    loss.backward()
    return loss.detach(), {_clean(n): p.grad for n, p in lm.named_parameters()}, store


def test_hf_model_options_keep_loss_and_gradients(family="qwen3_swa"):  # a sliding and a full layer in one unit
    want_loss, want_grads, _ = _hf_step(family)
    loss, grads, store = _hf_step(family, cpu_offload=True, blocks_per_checkpoint=2)
    assert store.stored == 1 and store.max_device_inputs == 1  # 2 layers, one unit: its hidden states
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[n], want_grads[n]) for n in want_grads)
    loss, grads, _ = _hf_step(family, tile=8, cpu_offload=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for n, want in want_grads.items():
        torch.testing.assert_close(grads[n], want, rtol=1e-5, atol=1e-6)
