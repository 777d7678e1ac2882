"""Logs stay readable: DeepSpeed's calls of torch.distributed's renamed collectives are silenced, nothing else is."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from grpo.device import quiet_deepspeed_deprecations


def _caught(call) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_deepspeed_deprecations()
        call()
    return [str(w.message) for w in seen]


def _collective(name: str):
    def call():
        with pytest.raises(Exception):  # no process group here: the deprecation warns before the call fails
            getattr(dist, name)(None, None)
    return call


def test_the_collectives_deepspeed_calls_warn_without_the_filter():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _collective("all_gather_into_tensor")()
    assert any("all_gather_into_tensor` is deprecated" in str(w.message) for w in seen)


@pytest.mark.parametrize("name", ["all_gather_into_tensor", "reduce_scatter_tensor"])
def test_their_deprecations_are_silenced(name):
    assert not [m for m in _caught(_collective(name)) if "is deprecated" in m]


def test_other_deprecations_still_warn():
    # The same words from another module, and another deprecation from torch's module, are kept.
    def elsewhere():
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning)
        warnings.warn_explicit("`torch.distributed.foo` is deprecated.", FutureWarning, "c10d_logger.py", 83,
                               module="torch.distributed.c10d_logger")
    assert len(_caught(elsewhere)) == 2
