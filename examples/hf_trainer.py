"""``transformers.Trainer`` under context parallelism, offline: a tiny random Qwen3 on packed documents.

    torchrun --nproc-per-node 1 examples/hf_trainer.py   # the reference: the stock Trainer, one process
    torchrun --nproc-per-node 2 examples/hf_trainer.py   # CP 2: the same losses and gradient norms

On a CPU the processes train together over gloo (``use_cpu=True``), on GPUs over NCCL. ``MODEL=<folder>``
trains a Hugging Face folder instead of the tiny model.
"""

import os
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, Trainer, TrainingArguments

from titan_cp.integrations.transformers import context_parallel_trainer, tiny_qwen3_folder

world = int(os.environ.get("WORLD_SIZE", "1"))
cp = 2 if world > 1 else 1  # ranks per CP group; world // cp data-parallel groups
path = os.environ.get("MODEL") or tiny_qwen3_folder(tempfile.mkdtemp())  # built offline, the same in every process
if cp > 1:  # a subclass of Trainer that keeps its loop; the model's attention runs titan_cp's CP attention
    TrainerClass = context_parallel_trainer(Trainer, cp_size=cp, strategy="ring")
    attention = "titan_cp"
else:  # one process: the stock Trainer and the model's own attention
    TrainerClass, attention = Trainer, "eager"
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=torch.float32)
model.config.use_cache = False  # with the cache on, eager attention lets a flattened row's documents see each other
tokenizer = AutoTokenizer.from_pretrained(path)
texts = [f"Document {i}: " + "keys and values go round the ring. " * (1 + i % 5) for i in range(24)]
dataset = Dataset.from_dict({"input_ids": [tokenizer(text)["input_ids"] for text in texts]})
on_cpu = not torch.cuda.is_available()
args = TrainingArguments(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=4 // (world // cp),  # 4 documents a step over the data-parallel groups
    max_steps=3,
    learning_rate=3e-3,
    logging_steps=1,
    use_cpu=on_cpu,  # without it, accelerate runs each CPU process alone: refused by context_parallel_trainer
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
)
collate = DataCollatorWithFlattening(return_tensors="pt")  # one packed row; positions restart per document
trainer = TrainerClass(model=model, args=args, train_dataset=dataset, data_collator=collate)
trainer.train()
if trainer.is_world_process_zero():
    for record in trainer.state.log_history:
        if "loss" in record:
            print(f"step {record['step']} loss {record['loss']:.6f} grad_norm {record['grad_norm']:.6f}")
