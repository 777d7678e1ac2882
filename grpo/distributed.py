"""Gather per-sample values (rewards, group ids) from all ranks into one table in global sample order; agree on an
outside failure that only some ranks met; leave the process group when every rank ends together."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from grpo.errors import OutsideFailure

__all__ = ["gather_by_index", "agreed_outside_failure", "leave"]


@contextlib.contextmanager
def agreed_outside_failure(device: torch.device) -> Iterator[None]:
    """Collective: the block's OutsideFailure on any rank is raised on every rank, with the same message and code.

    A server may fail one rank's request and answer the other's: the rank that failed alone would leave its peers
    waiting in the next collective and exit with a line only rank 0 prints (errors.rank_exit), so nobody would say
    why. One small all-reduce per block, and only around blocks without collectives inside (ranks would otherwise
    meet in different collectives)."""
    failure: OutsideFailure | None = None
    try:
        yield
    except OutsideFailure as e:
        failure = e
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0.0 if failure is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            seen: list = [None] * dist.get_world_size()
            dist.all_gather_object(seen, None if failure is None else (str(failure), failure.code))
            message, code = next(s for s in seen if s is not None)  # the lowest rank's: the same line everywhere
            if failure is None or str(failure) != message:
                agreed = OutsideFailure(message, code)
                agreed.agreed = True
                raise agreed from failure
    if failure is not None:
        failure.agreed = True
        raise failure


def gather_by_index(values: Tensor, index: Tensor, total: int) -> Tensor:
    """Every rank contributes rows tagged with their global indices; every rank gets the full table.

    Ranks may hold different numbers of rows (padded for all_gather, which needs equal sizes). The check that every
    global index is filled exactly once runs on the gathered data, so all ranks fail together instead of hanging.
    Without an initialised process group the rows are just scattered locally.

    Args:
        values: [n] or [n, k] local rows.
        index: [n] long, the global position of each local row, in [0, total).
        total: number of rows over all ranks.

    Returns:
        [total] or [total, k] with row i = the value of global sample i, on values' device and dtype.

    Raises:
        ValueError: when an index is out of range, missing or contributed more than once.
    """
    if index.ndim != 1 or values.shape[0] != index.shape[0] or values.ndim not in (1, 2):
        raise ValueError(
            f"gather_by_index: values must be [n] or [n, k] and index [n], got {tuple(values.shape)} and "
            f"{tuple(index.shape)}"
        )
    out_device, out_dtype = values.device, values.dtype
    rows = values if values.ndim == 2 else values.unsqueeze(1)  # [n, k], also for a rank with no rows (n = 0)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rows, index = _all_gather_rows(rows, index.long())
    _check_exactly_once(index, total)
    table = torch.empty((total, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    table[index.to(rows.device)] = rows
    table = table.to(device=out_device, dtype=out_dtype)
    return table if values.ndim == 2 else table[:, 0]


def _all_gather_rows(rows: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """all_gather of [n_r, k] rows and [n_r] indices with per-rank n_r, concatenated in rank order."""
    # gloo only handles CPU tensors; NCCL/HCCL want the rows' accelerator.
    comm_device = torch.device("cpu") if dist.get_backend() == "gloo" else rows.device
    world = dist.get_world_size()
    rows, index = rows.to(comm_device), index.to(comm_device)

    n = torch.tensor([rows.shape[0]], dtype=torch.long, device=comm_device)
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    counts = [int(c.item()) for c in counts]
    max_n = max(counts)

    pad = max_n - rows.shape[0]
    rows_p = torch.cat([rows, rows.new_zeros((pad, rows.shape[1]))])
    index_p = torch.cat([index, index.new_full((pad,), -1)])
    all_rows = [torch.empty_like(rows_p) for _ in range(world)]
    all_index = [torch.empty_like(index_p) for _ in range(world)]
    dist.all_gather(all_rows, rows_p.contiguous())
    dist.all_gather(all_index, index_p.contiguous())
    return (
        torch.cat([r[:c] for r, c in zip(all_rows, counts)]),
        torch.cat([i[:c] for i, c in zip(all_index, counts)]),
    )


def _check_exactly_once(index: Tensor, total: int) -> None:
    idx = index.detach().long().cpu()
    bad = idx[(idx < 0) | (idx >= total)]
    if bad.numel():
        raise ValueError(f"gather_by_index: indices out of range [0, {total}): {bad[:8].tolist()}")
    hits = torch.bincount(idx, minlength=total)
    missing = (hits == 0).nonzero().flatten()
    repeated = (hits > 1).nonzero().flatten()
    if missing.numel() or repeated.numel():
        raise ValueError(
            f"gather_by_index: every global index in [0, {total}) must be filled exactly once; "
            f"missing {missing[:8].tolist()} ({missing.numel()} in all), "
            f"repeated {repeated[:8].tolist()} ({repeated.numel()} in all)"
        )


def leave() -> None:
    """Destroy the process group while the interpreter is still whole, when every rank ends together (done, bad
    input, a skip streak, an agreed outside failure). Without it gloo's worker threads can abort the process during
    interpreter finalisation ("terminate called without an active exception": SIGABRT, pytorch#190489), and the
    code a launcher passes on (2, 3, 75) becomes a kill. Not for a rank that ends alone: its peers still wait in a
    collective on the group, and tearing it down under them can hang (torchtitan#1342)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End a rank's process with `code` once `leave` has run, without the C++ part of the interpreter's shutdown.

    Destroying the group is not always enough: a 1-step nft run that had saved everything still died with SIGABRT
    ("terminate called without an active exception") on a loaded 2-core host (2026-12-04), turning exit 0 into the
    launcher's lost-rank 75. The abort comes from the static destructors that exit() runs, so the process runs its
    atexit handlers (the output_dir lock's release) and flushes its streams itself, then leaves by os._exit."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
