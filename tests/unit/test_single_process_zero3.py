"""What the recipe sets for a ZeRO-3 engine on one process and for its optimizer. That neither changes what is trained
(the contiguous all-reduce path on one process gives the coalesced reduce-scatter's gradients bit for bit) runs in a
fresh process: tests/recipe/test_single_process_zero3.py."""

import json

from grpo.config import load_config
from grpo.inputs import load_ds_config
from grpo.layout import derive_layout
from tests import ROOT

LORA = ROOT / "recipes/configs/tiny/grpo_lora.yaml"


def _ds(world: int, path: str = "ds_configs/zero3_fp32.json") -> dict:
    cfg = load_config(LORA, [f"deepspeed.config={path}"])
    return load_ds_config(cfg.deepspeed.config, cfg, derive_layout(cfg, world))


def test_one_process_skips_the_reduce_scatter_and_more_keep_it(tmp_path):
    assert _ds(1)["zero_optimization"]["reduce_scatter"] is False
    assert "reduce_scatter" not in _ds(2)["zero_optimization"]  # DeepSpeed's default: reduce-scatter
    written = json.loads((ROOT / "ds_configs/zero3_fp32.json").read_text())
    written["zero_optimization"]["reduce_scatter"] = True
    (tmp_path / "ds.json").write_text(json.dumps(written))
    assert _ds(1, str(tmp_path / "ds.json"))["zero_optimization"]["reduce_scatter"] is True  # the file's choice


def test_fused_adamw_is_on_for_the_cpu_unless_set():
    from grpo.device import fused_adamw

    assert fused_adamw(None) is True  # this machine's accelerator is the CPU
    assert fused_adamw(False) is False and fused_adamw(True) is True
    assert load_config(LORA).optim.fused is None
    assert load_config(LORA, ["optim.fused=false"]).optim.fused is False
