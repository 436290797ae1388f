"""A program run by the launcher tests (``python -m fastpersist.run _patched_program.py OUT [STATUS]``).

It imports safetensors' save_file by name first, as transformers does, saves a
torch checkpoint and a safetensors file per rank into OUT (a gloo process
group when started by torchrun), and writes what it saw as JSON: argv,
__name__, sys.path[0] and fastpersist.patch_stats().
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file as safe_save_file

out = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
state = {"w": torch.full((128, 256), float(rank))}  # 128 KiB: a page-aligned record in fastpersist's files
torch.save(state, os.path.join(out, f"rank{rank}.pt"))
safe_save_file(state, os.path.join(out, f"rank{rank}.safetensors"))
assert torch.equal(torch.load(os.path.join(out, f"rank{rank}.pt"))["w"], state["w"])

import fastpersist

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "stats": fastpersist.patch_stats()}, f)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
