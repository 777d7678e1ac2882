"""gather_by_index across two real gloo processes (in one process: tests/unit/test_distributed.py)."""

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo.device import free_port
from grpo.distributed import gather_by_index


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Interleaved global indices, unequal counts (3 on rank 0, 2 on rank 1), reversed local order.
        index = torch.tensor([4, 2, 0]) if rank == 0 else torch.tensor([3, 1])
        values = torch.stack([index.float() * 10, index.float() + 0.5], dim=1)
        table = gather_by_index(values, index, 5)
        expected = torch.stack([torch.arange(5.0) * 10, torch.arange(5.0) + 0.5], dim=1)
        assert torch.equal(table, expected), table
        assert torch.equal(gather_by_index(index.float(), index, 5), torch.arange(5.0))
        # A duplicate on one rank only: every rank must raise (not hang).
        bad = torch.tensor([0, 1]) if rank == 0 else torch.tensor([1, 2])
        try:
            gather_by_index(torch.zeros(2), bad, 4)
        except ValueError as err:
            assert "repeated [1]" in str(err) and "missing [3]" in str(err), err
        else:
            raise AssertionError("duplicate index not detected")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_process_gloo():
    mp.spawn(_worker, args=(2, free_port()), nprocs=2, join=True)


@pytest.mark.parametrize("nproc", [1, 2])
def test_no_deepspeed_shared_memory_buffer_is_left_in_dev_shm(nproc):
    """DeepSpeed's CPU accelerator never unlinks its 64 MiB per-rank /dev/shm buffer, made when LOCAL_SIZE is the
    world size (all ranks on one node: a 1-process run sets it; the deepspeed launcher does); init_distributed
    unlinks it once the ranks have mapped each other's (grpo.device.release_shm_buffer_name)."""
    import subprocess

    from tests import ROOT
    from tools.launch import launch_env, torchrun_cmd

    proc = subprocess.run(torchrun_cmd(nproc, [str(ROOT / "tests" / "recipe" / "shm_probe.py")]),
                          env=launch_env({"LOCAL_SIZE": str(nproc)}), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # the ranks print at once into one pipe: their reports may share a line
    reports = sorted(re.findall(r"rank \d+: made \w+, left \[[^\]]*\], all_reduce [\d.]+", proc.stdout))
    assert reports == [f"rank {r}: made True, left [], all_reduce {float(nproc)}" for r in range(nproc)], proc.stdout
