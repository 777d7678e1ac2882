"""The update's bookkeeping: running sums that stay on the device until the one reduce, and the non-finite loss
that must reach ZeRO-3 as a non-finite gradient."""

import math

import pytest
import torch
import torch.distributed as dist

from grpo.device import free_port
from grpo.loss import poison_nonfinite
from grpo.step import LossSums


@pytest.fixture()
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sums_stay_tensors_until_the_reduce(one_process_group):
    sums = LossSums(points=4)
    sums.add(torch.tensor(1.0), {"ratio": torch.tensor([1.0, 1.25]), "kl": torch.tensor(0.5)}, on_policy=True,
             point=2)
    sums.add(torch.tensor(3.0), {"ratio": torch.tensor([0.5, 1.0]), "kl": torch.tensor(1.5)}, on_policy=False)
    sums.add(torch.tensor(float("inf")), {"ratio": torch.tensor([1.0, 1.0]), "kl": torch.tensor(1.0)}, on_policy=False)
    # Nothing was read back to the host: a float here would mean a sync per backward pass.
    assert all(isinstance(v, torch.Tensor) for v in sums.sums.values())
    assert isinstance(sums.nonfinite, torch.Tensor) and isinstance(sums.ratio_dev, torch.Tensor)
    stats = sums.reduce(torch.device("cpu"))
    assert stats.loss == math.inf and stats.nonfinite_loss == 1.0
    assert stats.kl == pytest.approx(1.0) and stats.ratio_mean == pytest.approx((1.125 + 0.75 + 1.0) / 3)
    assert stats.ratio_max_dev == 0.25  # the on-policy pass only; the off-policy 0.5 does not count
    assert stats.extra == {"ratio_dev/t02_max": 0.25, "ratio_dev/t02_mean": 0.125}


def test_the_ratio_deviation_is_kept_per_transition(one_process_group):
    """Max and mean |ratio - 1| of the on-policy block per trained transition: the step's max is the largest of
    them, transitions never trained on-policy are not logged."""
    sums = LossSums(points=6)
    for point, ratio in ((0, [1.0, 1.0]), (3, [1 + 2**-19, 1 - 2**-18]), (3, [1.0, 1 + 2**-20]), (5, [1.0, 1.0])):
        sums.add(torch.tensor(0.0), {"ratio": torch.tensor(ratio)}, on_policy=True, point=point)
    sums.add(torch.tensor(0.0), {"ratio": torch.tensor([3.0, 3.0])}, on_policy=False, point=1)
    stats = sums.reduce(torch.device("cpu"))
    logged = {k: v for k, v in stats.metrics().items() if k.startswith("ratio_dev/")}
    assert set(logged) == {f"ratio_dev/t{j:02d}_{m}" for j in (0, 3, 5) for m in ("max", "mean")}
    assert logged["ratio_dev/t03_max"] == 2**-18 == stats.ratio_max_dev  # dyadic: exact in float32
    assert logged["ratio_dev/t03_mean"] == (2**-19 + 2**-18 + 2**-20) / 4
    assert logged["ratio_dev/t00_max"] == logged["ratio_dev/t05_mean"] == 0.0


def test_a_reduce_without_passes_reports_nothing_nonfinite(one_process_group):
    stats = LossSums().reduce(torch.device("cpu"))
    assert stats.nonfinite_loss == 0.0 and stats.loss is None and stats.ratio_max_dev is None


def test_poison_leaves_a_finite_loss_and_its_gradient_bit_for_bit():
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.tensor([0.3, -1.7], dtype=dtype, requires_grad=True)
        plain = (w * w).sum()
        (g_plain,) = torch.autograd.grad(plain, w)
        poisoned = poison_nonfinite((w * w).sum())
        (g_poisoned,) = torch.autograd.grad(poisoned, w)
        assert poisoned.dtype == dtype and torch.equal(poisoned, plain) and torch.equal(g_poisoned, g_plain)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_poison_turns_a_nonfinite_loss_into_a_nonfinite_gradient(bad):
    w = torch.tensor([0.3, -1.7], requires_grad=True)
    loss = poison_nonfinite((w * bad).sum() if math.isnan(bad) else (w * 0 + bad).sum())
    (g,) = torch.autograd.grad(loss, w)
    assert math.isnan(loss.item()) and torch.isnan(g).all()


# Flow-DPPO's masked share (grpo.trust_region), logged per trained transition: Objective.stats_per_point
def test_the_masked_share_is_logged_per_trained_transition(one_process_group):
    sums = LossSums(points=6, per_point=("dppo/masked_frac",))
    for point, share in ((1, 0.0), (4, 0.5), (4, 0.25), (1, 0.0)):
        sums.add(torch.tensor(0.0), {"ratio": torch.ones(2), "dppo/masked_frac": torch.tensor(share)}, point=point)
    stats = sums.reduce(torch.device("cpu")).metrics()
    assert stats["dppo/masked_frac"] == pytest.approx(0.75 / 4)
    per = {k: v for k, v in stats.items() if k.startswith("dppo/masked_frac/")}
    assert per == {"dppo/masked_frac/t01": 0.0, "dppo/masked_frac/t04": 0.375}


def test_a_rank_without_passes_still_reduces_the_per_transition_share(one_process_group):
    stats = LossSums(points=4, per_point=("dppo/masked_frac",)).reduce(torch.device("cpu"))
    assert not any(k.startswith("dppo/") for k in stats.metrics())
