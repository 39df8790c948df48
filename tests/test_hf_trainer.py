"""Context parallelism inside ``transformers.Trainer`` and TRL's ``SFTTrainer`` (``context_parallel_trainer``).

The oracle is the stock Trainer on one process (eager attention, ``use_cache=False``) on the same
data: the first three steps' losses and gradient norms, and the eval loss of the whole set. The
CP runs use the same Trainer class made context-parallel, on CP 2 (2 ranks), on dp 2 x cp 2 and
on one CP 4 group (4 ranks); the cases share out the model families (Qwen3, Llama, gpt-oss with
windows and sinks, Qwen3.5's Gated DeltaNet hybrid), the two trainers, the strategies (ring, all-gather, Ulysses, hybrid), gradient
accumulation, ``average_tokens_across_devices`` off, gradient checkpointing, FSDP2, ``predict()``
and bf16 autocast (run, compared loosely), so that each appears at least once; one pool call per
world size.

Tolerances: the CP runs add the same fp32 numbers in another order: loss within 1e-6 (absolute, a
loss of ~6), gradient norm within 1e-5 relative.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
trl = pytest.importorskip("trl", reason="trl is in the trainer extra")
datasets = pytest.importorskip("datasets", reason="datasets is in the dev extra")

from titan_cp.integrations.transformers import context_parallel_trainer  # noqa: E402

STEPS = 3
# documents of 3-40 tokens (the byte tokenizer's ids), deterministic; three steps stay inside the first epoch
_G = torch.Generator().manual_seed(0)
TRAIN_DOCS = [
    torch.randint(2, 200, (int(n),), generator=_G).tolist() for n in torch.randint(3, 41, (80,), generator=_G)
]
EVAL_DOCS = [torch.randint(2, 200, (int(n),), generator=_G).tolist() for n in torch.randint(3, 41, (7,), generator=_G)]
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)),
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "gpt_oss": (
        "GptOssConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
             layer_types=["sliding_attention", "full_attention"], num_local_experts=2, num_experts_per_tok=1),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]),
    ),
}  # fmt: skip


def make_folder(path, family: str, seed: int = 0):
    """A random tiny ``family`` model (hidden 32, 2 layers) with a byte-level tokenizer, saved to ``path``."""
    from titan_cp.integrations.hf_tiny import byte_tokenizer  # noqa: PLC0415

    tokenizer = byte_tokenizer(path)
    name, fields = FAMILIES[family]
    config = getattr(transformers, name)(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id, **fields,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) + (1.0 if "norm" in n else 0.0))
    model.save_pretrained(str(path))
    return str(path)


def _env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def _run(rank, world, case: dict, out_dir: str) -> dict:
    """Train ``case`` for three steps (and evaluate) on this rank; the losses, grad norms and eval loss."""
    _env(rank, world)
    folder, kind, cp = case["folder"], case["trainer"], case.get("cp", 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="titan_cp" if cp else "eager")
    model.config.use_cache = False
    per_device = case["batch"] // max(1, world // max(cp, 1))
    common = dict(
        output_dir=f"{out_dir}/{case['name']}-{world}-{cp}", per_device_train_batch_size=per_device,
        per_device_eval_batch_size=case["eval_batch"], gradient_accumulation_steps=case.get("ga", 1),
        max_steps=case.get("steps", STEPS), learning_rate=3e-3, warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=1.0,
        logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="steps" if case.get("save_steps") else "no", save_steps=case.get("save_steps", 500), seed=0, data_seed=0,
        train_sampling_strategy="sequential", average_tokens_across_devices=case.get("average", True),
        bf16=case.get("bf16", False), gradient_checkpointing=case.get("gc", False), disable_tqdm=True,
        dataloader_num_workers=0, include_num_input_tokens_seen="all",
    )  # fmt: skip
    train = datasets.Dataset.from_dict({"input_ids": TRAIN_DOCS})
    evaluate = datasets.Dataset.from_dict({"input_ids": EVAL_DOCS})
    base = trl.SFTTrainer if kind == "sft" else transformers.Trainer
    cls = context_parallel_trainer(base, cp_size=cp, **case.get("cp_kwargs", {})) if cp else base
    if kind == "sft":
        args = trl.SFTConfig(**common, packing=True, padding_free=True, max_length=64, dataset_num_proc=None)
        trainer = cls(model=model, args=args, train_dataset=train, eval_dataset=evaluate)
    else:
        args = transformers.TrainingArguments(**common)
        collate = transformers.DataCollatorWithFlattening(return_tensors="pt")
        trainer = cls(model=model, args=args, train_dataset=train, eval_dataset=evaluate, data_collator=collate)
    trainer.train(resume_from_checkpoint=case.get("resume"))
    logs = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    result = {"loss": [r["loss"] for r in logs], "grad_norm": [r["grad_norm"] for r in logs]}
    result["tokens_seen"] = trainer.state.num_input_tokens_seen
    if case.get("save_model"):
        trainer.save_model(case["save_model"].format(world=world, cp=cp))
        if case.get("steps"):  # the checkpoint test: the trained weights, no evaluation
            result["state"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            return result
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    if case.get("predict"):
        out = trainer.predict(evaluate)
        result["predicted"] = _next_token_logits(out)
        if kind == "flat":  # no labels: the logits alone, the same
            trainer.data_collator = _without_labels(trainer.data_collator)
            bare = trainer.predict(evaluate)
            assert bare.label_ids is None
            assert torch.equal(torch.as_tensor(bare.predictions), torch.as_tensor(out.predictions))
    return result


def _without_labels(collate):
    def call(features):
        batch = collate(features)
        batch.pop("labels")
        return batch

    return call


def _next_token_logits(out) -> tuple[float, int]:
    """Sum over every labelled token of its predecessor's logit for it, and their count: the same
    however the set is batched, and wrong if a logit lands at another token's place."""
    logits, labels = torch.as_tensor(out.predictions).double(), torch.as_tensor(out.label_ids)
    target = labels[:, 1:]
    valid = target != -100
    picked = logits[:, :-1].gather(-1, target.clamp_min(0)[..., None])[..., 0]
    return float(picked[valid].sum()), int(valid.sum())


def _cases(folders: dict, tmp) -> dict:
    # "batch": rows per step over all dp ranks; eval: 7 documents, 2 per device -> a last partial batch
    return {
        2: [
            dict(name="sft_qwen3", folder=folders["qwen3"], trainer="sft", batch=2, eval_batch=2, cp=2),
            dict(name="flat_oss", folder=folders["gpt_oss"], trainer="flat", batch=4, eval_batch=2, cp=2, ga=2,
                 average=False, predict=True, cp_kwargs=dict(strategy="ulysses", balance="doc_zigzag")),
            dict(name="sft_qwen3_bf16", folder=folders["qwen3"], trainer="sft", batch=2, eval_batch=2, cp=2,
                 bf16=True),  # TRL's default: autocast; compared with the fp32 run, loosely
            dict(name="sft_qwen35", folder=folders["qwen3_5"], trainer="sft", batch=2, eval_batch=2, cp=2,
                 cp_kwargs=dict(strategy="allgather")),  # Gated DeltaNet layers: their state across ranks
        ],
        4: [
            dict(name="sft_llama", folder=folders["llama"], trainer="sft", batch=4, eval_batch=2, cp=2, ga=2,
                 cp_kwargs=dict(activation_checkpointing="full", cpu_offload=True, blocks_per_checkpoint=2,
                                tile_tokens=8)),  # the memory options: the same numbers
            dict(name="flat_qwen3", folder=folders["qwen3"], trainer="flat", batch=4, eval_batch=2, cp=2, gc=True,
                 predict=True, cp_kwargs=dict(strategy="allgather", chunked_loss=True)),
            dict(name="hybrid_qwen3", folder=folders["qwen3"], trainer="sft", batch=2, eval_batch=2, cp=4,
                 cp_kwargs=dict(strategy="hybrid", ulysses_degree=2, balance="doc_zigzag")),  # one CP 4 group
            dict(name="fsdp_llama", folder=folders["llama"], trainer="flat", batch=4, eval_batch=2, cp=2, ga=2,
                 save_model=str(tmp / "fsdp-{world}-{cp}"), cp_kwargs=dict(fsdp=True, activation_checkpointing="full")),
        ],
    }  # fmt: skip


def _reference(case: dict) -> dict:
    """The same case on one process, the whole step's rows per batch, the eval set in one batch: the stock
    Trainer with eager attention; for gpt-oss and Qwen3.5 the factory's on one process (``transformers``'
    eager gpt-oss does not keep a flattened row's documents apart: 6.1644 where each document alone gives
    6.1433; its torch Gated DeltaNet refuses a flattened row without flash-linear-attention; titan_cp's
    one-process attention and linear layers are checked per document in test_hf_integration and
    test_hf_hybrid)."""
    own = "gpt_oss" in case["folder"] or "qwen3_5" in case["folder"]
    return {**case, "cp": 1 if own else 0, "eval_batch": len(EVAL_DOCS)}


def _all(rank, world, cases, out_dir):
    return [_run(rank, world, case, out_dir) for case in cases]


def _close(got: dict, want: dict, name: str) -> None:
    assert len(got["loss"]) == len(want["loss"]) == STEPS, name
    # fp32 summation order only: a loss near 6.4 is exact to about 1e-6, relative 2e-7
    assert got["loss"] == pytest.approx(want["loss"], rel=3e-7, abs=1e-6), name
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=3e-7, abs=1e-6), name
    assert got["tokens_seen"] == want["tokens_seen"], name
    if "predicted" in want:
        assert got["predicted"][1] == want["predicted"][1], name
        assert got["predicted"][0] == pytest.approx(want["predicted"][0], abs=1e-4), name  # ~100 logits of O(1)


def test_trainer_and_sft_trainer_under_cp_equal_one_process(dist_pools, tmp_path):
    folders = {family: make_folder(tmp_path / family, family) for family in FAMILIES}
    cases = _cases(folders, tmp_path)
    exact = {w: [c for c in cases[w] if not c.get("bf16")] for w in cases}
    refs = dist_pools.run(1, _all, [_reference(c) for w in cases for c in exact[w]], str(tmp_path))[0]
    got = {w: dist_pools.run(w, _all, cases[w], str(tmp_path), timeout=600) for w in cases}
    i = 0
    for w in cases:
        for j in range(len(cases[w])):
            for r in got[w]:
                assert r[j] == got[w][0][j]  # every rank logs the same numbers
            if cases[w][j].get("bf16"):
                fp32 = got[w][0][0]
                assert got[w][0][j]["loss"] == pytest.approx(fp32["loss"], abs=0.05)
                assert got[w][0][j]["loss"] != fp32["loss"]  # it ran in bf16
                continue
            _close(got[w][0][j], refs[i], cases[w][j]["name"])
            i += 1
    # FSDP's save_model gathers the whole weights: the same as one process's after the same steps
    one = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fsdp-1-0")).state_dict()
    fsdp = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fsdp-4-2")).state_dict()
    assert set(one) == set(fsdp)
    assert max(float((one[k] - fsdp[k]).abs().max() / one[k].abs().max()) for k in one) < 1e-5


# ---- what is refused, naming the fix --------------------------------------------------------------


def _tiny(attn: str = "titan_cp", family: str = "llama"):
    name, fields = FAMILIES[family]
    config = getattr(transformers, name)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=256, **fields
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def _rows(seed: int = 0, lens=(5, 9, 2, 8)) -> dict:
    collate = transformers.DataCollatorWithFlattening(return_tensors="pt")
    g = torch.Generator().manual_seed(seed)
    return collate([{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in lens])


def test_misuse_on_one_process_is_refused_naming_the_fix():
    from titan_cp.attention import CPHandle  # noqa: PLC0415
    from titan_cp.integrations.transformers import apply_cp, shard_batch  # noqa: PLC0415

    one = CPHandle(None)
    local = shard_batch(_rows(), one)
    with pytest.raises(ValueError, match=r"runs attn_implementation='titan_cp' but no CP mesh is bound.*apply_cp"):
        _tiny()(**local)  # a model apply_cp never bound
    row = _rows()
    ids = row["input_ids"]
    with pytest.raises(ValueError, match=r"labels look already shifted"):  # shifted by the user, then again
        shard_batch({**row, "labels": torch.roll(ids, -1, 1)}, one)
    with pytest.raises(ValueError, match=r"shift_labels equal input_ids .* not shifted"):
        shard_batch({"input_ids": ids, "position_ids": row["position_ids"], "shift_labels": ids}, one)
    with pytest.raises(ValueError, match=r"position_ids has shape \(1, 23\), input_ids \(1, 24\)"):
        shard_batch({**row, "position_ids": row["position_ids"][:, 1:]}, one)
    with pytest.raises(ValueError, match=r"num_items_in_batch = 0: it must be the step's count"):
        shard_batch(row, one, num_items_in_batch=0)
    with pytest.raises(ValueError, match=r"no loss-bearing token: every label is -100"):
        shard_batch({**row, "labels": torch.full_like(ids, -100)}, one)
    model = _tiny()
    apply_cp(model, None)
    with pytest.raises(ValueError, match=r"model.generate\(\) after apply_cp: .* titan_cp's generation"):
        model.generate(ids[:, :4], max_new_tokens=2)
    assert _tiny("sdpa").generate(ids[:, :4], max_new_tokens=2).shape == (1, 6)  # only the bound model refuses
    cp2 = context_parallel_trainer(transformers.Trainer, cp_size=2)
    with pytest.raises(ValueError, match=r"cp_size=2\): the world has 1 rank, not a multiple"):
        cp2(model=model, args=_args("/tmp/unused"))
    with pytest.raises(ValueError, match=r"label_smoothing_factor = 0.1: the label smoother shifts labels again"):
        cp2(model=model, args=_args("/tmp/unused", label_smoothing_factor=0.1))
    with pytest.raises(ValueError, match=r"train_sampling_strategy = 'batch_rebalance' spreads rows over every rank"):
        cp2(model=model, args=_args("/tmp/unused", train_sampling_strategy="batch_rebalance"))
    with pytest.raises(ValueError, match=r"chunked_loss=True\) is for transformers.Trainer with DDP: .*SFTTrainer"):
        context_parallel_trainer(trl.SFTTrainer, cp_size=2, chunked_loss=True)
    for kwargs, message in [
        (dict(cp_size=0), r"cp_size=0\): a positive integer"),
        (dict(cp_size=2, balance="rows"), r"balance='rows'\): one of"),
        (dict(cp_size=2, ulysses_degree=2), r"ulysses_degree=2\) is for strategy='hybrid'"),
        (dict(cp_size=2, activation_checkpointing="all"), r"activation_checkpointing='all'\): one of"),
        (dict(cp_size=2, cpu_offload=True), r"cpu_offload=, blocks_per_checkpoint=\) shape titan_cp's activation"),
    ]:
        with pytest.raises(ValueError, match=message):
            context_parallel_trainer(transformers.Trainer, **kwargs)


def _args(out: str, **fields):
    return transformers.TrainingArguments(output_dir=out, use_cpu=True, report_to=[], **fields)


def test_a_training_batch_without_labels_is_refused_naming_the_fix(tmp_path):
    trainer = context_parallel_trainer(transformers.Trainer, cp_size=1)(model=_tiny(), args=_args(str(tmp_path)))
    row = {k: v for k, v in _rows().items() if k != "labels"}
    with pytest.raises(ValueError, match=r"training batch without labels \(or shift_labels\).*give the collator"):
        trainer.compute_loss(trainer.model.train(), row)


def test_mixed_qkv_dtypes_under_autocast_run_at_the_autocast_dtype():
    """Qwen3's q/k norms return fp32 under CPU autocast while v is bf16: run as SDPA would, in bf16."""
    from titan_cp.integrations.transformers import apply_cp  # noqa: PLC0415

    model = _tiny(family="qwen3")
    local = apply_cp(model, None).shard(_rows())
    with torch.no_grad():
        full = model(**local).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(**local).loss
    assert torch.isfinite(low) and abs(float(low) - float(full)) < 0.05


def _misuse_under_cp2(rank, world):
    from tests.dist_utils import get_mesh  # noqa: PLC0415
    from titan_cp.attention import CPHandle  # noqa: PLC0415
    from titan_cp.integrations.transformers import apply_cp, tiny_qwen3_folder  # noqa: PLC0415

    cp_mesh = get_mesh((2,), ("cp",))
    model = _tiny()
    cp = apply_cp(model, cp_mesh)
    found = []
    for attempt in (
        lambda: model(**_rows(), use_cache=False),  # the whole batch, never sharded
        lambda: model(**CPHandle(None).shard(_rows())),  # sharded for one device
        lambda: cp.shard(_rows(seed=rank)),  # each cp rank its own rows
        lambda: cp.shard(_rows(), dp_mesh=cp_mesh),  # a dp mesh that holds the cp peers
        lambda: _default_args_trainer(rank, world),  # torchrun on a CPU, use_cpu not set: each process alone
        lambda: tiny_qwen3_folder(tempfile.mkdtemp()),  # after the process group started: rank 0 alone writes
    ):
        try:
            attempt()
            found.append(None)
        except ValueError as e:
            found.append(str(e))
    return found


def _default_args_trainer(rank: int, world: int):
    """The factory's Trainer with default ``TrainingArguments`` in a 2-process launch on a CPU:
    ``accelerate`` sees no distributed run (no accelerator, ``use_cpu=False``) and would set up no DDP."""
    _env(rank, world)
    args = transformers.TrainingArguments(output_dir="/tmp/unused", report_to=[])
    context_parallel_trainer(transformers.Trainer, cp_size=2)(model=_tiny(), args=args)


def test_misuse_under_cp2_is_refused_naming_the_fix(dist_pools):
    for rank, found in enumerate(dist_pools.run(2, _misuse_under_cp2)):
        layout, mesh_size, rows, dp, alone, folder = found
        assert layout and "did not come through the layout (no cp_doc_lens): shard each batch" in layout
        assert mesh_size and "sharded for a cp size of 1; shard it with the handle apply_cp returned" in mesh_size
        assert rows and "passed different rows to shard_batch" in rows and "data-parallel ranks only" in rows
        assert dp and "dp_mesh holds ranks [0, 1] of this rank's cp group" in dp
        assert alone and "2 processes were launched but accelerate runs 1 of them together" in alone
        assert "on a CPU set use_cpu=True" in alone
        assert (
            (folder is None) if rank == 0 else ("build the folder in every process before init_process_group" in folder)
        )


def test_checkpoints_resume_on_another_cp_size_and_save_model_loads(dist_pools, tmp_path):
    """CP 2 saves at step 2 and runs to 4; CP 1 resumes from step 2 with the same losses; the
    folder ``save_model`` writes loads with ``from_pretrained`` (any attention) as the trained weights."""
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    base = dict(folder=folder, trainer="flat", batch=2, eval_batch=2, steps=4)
    saved = tmp_path / "final"
    straight = dist_pools.run(
        2, _run, dict(base, name="save", cp=2, save_steps=2, save_model=str(saved)), str(tmp_path), timeout=600
    )[0]
    checkpoint = tmp_path / "save-2-2" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "optimizer.pt").exists()
    resumed = dist_pools.run(
        1, _run, dict(base, name="resume", cp=1, resume=str(checkpoint), save_model=str(tmp_path / "r")), str(tmp_path)
    )[0]
    assert resumed["loss"][-2:] == pytest.approx(straight["loss"][2:], abs=1e-6)
    assert resumed["grad_norm"][-2:] == pytest.approx(straight["grad_norm"][2:], rel=1e-5)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(saved), attn_implementation="eager")
    state = loaded.state_dict()
    assert set(state) <= set(straight["state"])
    assert all(torch.equal(state[k], straight["state"][k]) for k in state)
    initial = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert not torch.equal(initial["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])
