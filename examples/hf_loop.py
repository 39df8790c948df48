"""A Hugging Face model under context parallelism in your own loop, offline: a tiny random Qwen3.

    torchrun --nproc-per-node 1 examples/hf_loop.py   # one process (CP 1): the reference
    torchrun --nproc-per-node 2 examples/hf_loop.py   # CP 2: the same losses and gradient norms
    torchrun --nproc-per-node 4 examples/hf_loop.py   # FSDP 2 x CP 2 (CP=4: one CP 4 group)

``apply_cp`` binds the model to the cp mesh, ``shard_batch`` gives each rank its share of the packed
row (labels shifted inside each document first), the model's loss is this rank's summed cross-entropy
over the step's loss-bearing tokens, and FSDP2 sums the gradients over every rank. On a CPU it runs on
gloo, on GPUs on NCCL. ``MODEL=<folder>`` trains a Hugging Face folder instead of the tiny model.
"""

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening

from titan_cp.integrations.transformers import apply_cp, apply_fsdp, tiny_qwen3_folder

device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
world = int(os.environ["WORLD_SIZE"])
cp = int(os.environ.get("CP", 2 if world % 2 == 0 else 1))  # ranks per CP group; world // cp data-parallel ranks
path = os.environ.get("MODEL") or tiny_qwen3_folder(tempfile.mkdtemp())  # built offline, the same in every process
mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="titan_cp", dtype=torch.float32).to(device)
cp_handle = apply_cp(model, mesh["cp"], strategy="ring", balance="doc_zigzag")  # shards every batch below
apply_fsdp(model, init_device_mesh(device.type, (world,)))  # FSDP2 over all dp x cp ranks, gradients summed
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
collate = DataCollatorWithFlattening(return_tensors="pt")  # one packed row; positions restart per document
dp_rank = mesh["dp"].get_local_rank()
for step in range(3):
    texts = [
        f"Step {step}, data rank {dp_rank}, document {i}: " + "keys go round the ring. " * (i + 1) for i in range(4)
    ]
    row = collate([{"input_ids": tokenizer(text)["input_ids"]} for text in texts])
    local = cp_handle.shard(row, dp_mesh=mesh["dp"], pad_token_id=tokenizer.pad_token_id, device=device)
    loss = model(**local).loss  # this rank's summed cross-entropy / loss-bearing tokens of the whole step
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the step's mean loss: the ranks' shares summed
    if dist.get_rank() == 0:
        print(f"step {step + 1} loss {total.item():.6f} grad_norm {grad_norm.item():.6f}")
dist.destroy_process_group()
