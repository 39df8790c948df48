"""Context parallelism inside ``transformers.Trainer`` and TRL's ``SFTTrainer`` (``context_parallel_trainer``).

The oracle is the stock Trainer on one process (eager attention, ``use_cache=False``) on the same
data: the first three steps' losses and gradient norms, and the eval loss of the whole set. The
CP runs use the same Trainer class made context-parallel, on CP 2 (2 ranks) and on dp 2 x cp 2
(4 ranks), each case a different model family, trainer, gradient accumulation and
``average_tokens_across_devices``, so that each family (Qwen3, Llama, gpt-oss with windows and
sinks) and each option appears once; one pool call per world size.

Tolerances: the CP runs add the same fp32 numbers in another order: loss within 1e-6 (absolute, a
loss of ~6), gradient norm within 1e-5 relative.
"""

from __future__ import annotations

import os

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
}  # fmt: skip


def make_folder(path, family: str, seed: int = 0):
    """A random tiny ``family`` model (hidden 32, 2 layers) with a byte-level tokenizer, saved to ``path``."""
    from titan_cp.testing.hf import byte_tokenizer  # noqa: PLC0415

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
        max_steps=STEPS, learning_rate=3e-3, warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=1.0,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
        train_sampling_strategy="sequential", average_tokens_across_devices=case.get("average", True),
        bf16=case.get("bf16", False), gradient_checkpointing=case.get("gc", False), disable_tqdm=True,
        dataloader_num_workers=0,
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
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    result = {"loss": [r["loss"] for r in logs], "grad_norm": [r["grad_norm"] for r in logs]}
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    return result


def _cases(folders: dict, tmp) -> dict:
    # "batch": rows per step over all dp ranks; eval: 7 documents, 2 per device -> a last partial batch
    return {
        2: [
            dict(name="sft_qwen3", folder=folders["qwen3"], trainer="sft", batch=2, eval_batch=2, cp=2),
            dict(name="flat_oss", folder=folders["gpt_oss"], trainer="flat", batch=4, eval_batch=2, cp=2, ga=2,
                 average=False, cp_kwargs=dict(strategy="ulysses", balance="doc_zigzag")),
        ],
        4: [
            dict(name="sft_llama", folder=folders["llama"], trainer="sft", batch=4, eval_batch=2, cp=2, ga=2),
            dict(name="flat_qwen3", folder=folders["qwen3"], trainer="flat", batch=4, eval_batch=2, cp=2, gc=True,
                 cp_kwargs=dict(strategy="allgather")),
        ],
    }  # fmt: skip


def _reference(case: dict) -> dict:
    """The same case on one process, the whole step's rows per batch, the eval set in one batch: the stock
    Trainer with eager attention; for gpt-oss the factory's on one process (``transformers``' eager
    attention lets packed documents see each other in its sliding layers: 6.1644 where each document
    alone gives 6.1433; titan_cp's one-process attention is checked per document in test_hf_integration)."""
    return {**case, "cp": 1 if "gpt_oss" in case["folder"] else 0, "eval_batch": len(EVAL_DOCS)}


def _all(rank, world, cases, out_dir):
    return [_run(rank, world, case, out_dir) for case in cases]


def _close(got: dict, want: dict, name: str) -> None:
    assert len(got["loss"]) == len(want["loss"]) == STEPS, name
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), name
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-6), name


def test_trainer_and_sft_trainer_under_cp_equal_one_process(dist_pools, tmp_path):
    folders = {family: make_folder(tmp_path / family, family) for family in FAMILIES}
    cases = _cases(folders, tmp_path)
    refs = dist_pools.run(1, _all, [_reference(c) for w in cases for c in cases[w]], str(tmp_path))[0]
    got = {w: dist_pools.run(w, _all, cases[w], str(tmp_path), timeout=600) for w in cases}
    i = 0
    for w in cases:
        for j in range(len(cases[w])):
            for r in got[w]:
                assert r[j] == got[w][0][j]  # every rank logs the same numbers
            _close(got[w][0][j], refs[i], cases[w][j]["name"])
            i += 1
