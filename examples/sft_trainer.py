"""TRL's ``SFTTrainer`` under context parallelism, offline: a tiny random Qwen3 on packed text.

    torchrun --nproc-per-node 1 examples/sft_trainer.py   # the reference: the stock SFTTrainer, one process
    torchrun --nproc-per-node 2 examples/sft_trainer.py   # CP 2: the same losses and gradient norms (fp32)

On a CPU the processes train together over gloo (``use_cpu=True``) in fp32; on GPUs over NCCL in bf16
(TRL's default). ``MODEL=<folder>`` trains a Hugging Face folder instead of the tiny model.
"""

import os
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from titan_cp.integrations.transformers import context_parallel_trainer, tiny_qwen3_folder

world = int(os.environ.get("WORLD_SIZE", "1"))
cp = 2 if world > 1 else 1  # ranks per CP group; world // cp data-parallel groups
path = os.environ.get("MODEL") or tiny_qwen3_folder(tempfile.mkdtemp())  # built offline, the same in every process
if cp > 1:  # a subclass of SFTTrainer that keeps its loop; the model's attention runs titan_cp's CP attention
    Trainer = context_parallel_trainer(SFTTrainer, cp_size=cp, strategy="ring")
    attention = "titan_cp"
else:  # one process: the stock SFTTrainer and the model's own attention
    Trainer, attention = SFTTrainer, "eager"
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=torch.float32)
model.config.use_cache = False  # with the cache on, eager attention lets a packed row's documents see each other
tokenizer = AutoTokenizer.from_pretrained(path)
dataset = Dataset.from_dict(
    {"text": [f"Document {i}: " + "keys and values go round the ring. " * (1 + i % 5) for i in range(24)]}
)
on_cpu = not torch.cuda.is_available()
args = SFTConfig(
    output_dir=tempfile.mkdtemp(),
    packing=True,  # documents packed into rows of max_length tokens ...
    padding_free=True,  # ... kept apart by their positions: what titan_cp's layouts shard
    max_length=128,
    per_device_train_batch_size=2 // (world // cp),  # 2 packed rows a step over the data-parallel groups
    max_steps=3,
    learning_rate=3e-3,
    logging_steps=1,
    use_cpu=on_cpu,  # without it, accelerate runs each CPU process alone: refused by context_parallel_trainer
    bf16=not on_cpu,  # TRL's default; CPU autocast in bf16 runs too, but not to one process's fp32 losses
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
trainer.train()
if trainer.is_world_process_zero():
    for record in trainer.state.log_history:
        if "loss" in record:
            print(f"step {record['step']} loss {record['loss']:.6f} grad_norm {record['grad_norm']:.6f}")
