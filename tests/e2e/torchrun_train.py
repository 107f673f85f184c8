"""The README's training loop, as a user runs it: `torchrun --nproc-per-node 2 torchrun_train.py MODEL_DIR OUT_DIR`.

Each rank writes OUT_DIR/rank<N>.json: the loss of each of three AdamW steps and this rank's logits shape. A file
per rank, because the ranks share torchrun's stdout and their lines can interleave there.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import cpbench

path, out_dir = sys.argv[1], Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(
    path, attn_implementation="sdpa", dtype=torch.float32,
    distributed_config=cpbench.DistributedConfig(cp_size=2),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
torch.manual_seed(0)
input_ids = torch.randint(0, model.config.vocab_size, (2, 32))
batch = {"input_ids": input_ids, "labels": input_ids}  # the same full batch on both ranks of the cp group
losses = []
for _ in range(3):
    out = model(**batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(out.loss.item())
rank = torch.distributed.get_rank()
record = {"rank": rank, "losses": losses, "logits_shape": list(out.logits.shape)}
(out_dir / f"rank{rank}.json").write_text(json.dumps(record))
# Every rank reaches the barrier before any tears its process group down: a gloo rank whose peer closes the
# connection while its own group is alive can abort ("terminate called without an active exception").
torch.distributed.barrier()
torch.distributed.destroy_process_group()
