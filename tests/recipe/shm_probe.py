"""Run under torchrun by tests/recipe/test_distributed.py: after grpo.device.init_distributed no rank's DeepSpeed
shared-memory buffer name is left in /dev/shm (the buffer, when DeepSpeed made one, still mapped), and the process
group still works."""

import sys

import torch
import torch.distributed as dist

from grpo import device

info = device.init_distributed()
dist.barrier()  # every rank past its own unlink
left = [str(p) for p in map(device.shm_buffer_path, range(info.world_size)) if p.exists()]
with open("/proc/self/maps") as maps:  # the buffer is still mapped (its name gone) when DeepSpeed made one
    made = any(device.shm_buffer_path(info.rank).name in line for line in maps)
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {info.rank}: made {made}, left {left}, all_reduce {total.item()}", flush=True)
dist.destroy_process_group()
sys.exit(0 if not left and total.item() == info.world_size else 1)
