"""gather_by_index in one process (across two real gloo processes: tests/recipe/test_distributed.py)."""

import pytest
import torch

from grpo.distributed import gather_by_index


def test_single_process_scatters_locally():
    values = torch.tensor([[10.0, 1.0], [30.0, 3.0], [20.0, 2.0]])
    index = torch.tensor([0, 2, 1])
    table = gather_by_index(values, index, 3)
    assert torch.equal(table, torch.tensor([[10.0, 1.0], [20.0, 2.0], [30.0, 3.0]]))
    flat = gather_by_index(torch.tensor([7, 8, 9]), torch.tensor([2, 0, 1]), 3)
    assert torch.equal(flat, torch.tensor([8, 9, 7])) and flat.dtype == torch.int64


@pytest.mark.parametrize(
    "index,total,match",
    [
        ([0, 1, 1], 3, r"repeated \[1\]"),
        ([0, 1, 2], 4, r"missing \[3\]"),
        ([0, 1, 5], 3, "out of range"),
    ],
)
def test_single_process_errors(index, total, match):
    with pytest.raises(ValueError, match=match):
        gather_by_index(torch.zeros(3), torch.tensor(index), total)
