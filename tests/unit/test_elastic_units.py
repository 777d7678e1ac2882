"""Fast checks (no launch) of resuming on another world size: which process counts a checkpoint accepts, the refusal
before anything is written, the engine's universal-load switch, the re-cut EMA/lagging shards and the lifetime of the
universal conversion. The runs themselves are in tests/recipe/test_elastic_resume.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from grpo import checkpoint as ckpt
from grpo.checkpoint import universal
from grpo import compat
from grpo.config import load_config, to_dict
from grpo.ema import ShardedEMA
from grpo.errors import ConfigError
from grpo.inputs import check_inputs
from grpo.layout import valid_world_sizes
from tests import ROOT, TINY, snapshot

LORA = str(ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml")
BATCH = ["batch.prompts_per_step=2", "sampling.group_size=4", "batch.micro_batch_size=1"]  # 8 images per step


def _cfg(tmp: Path, *extra: str):
    return load_config(LORA, [*BATCH, f"output_dir={tmp / 'run'}", f"model.path={TINY}",
                              f"data.cache_dir={tmp / 'cache'}", *extra])


def _meta(cfg, world: int) -> dict:
    return {"format": ckpt.FORMAT, "step": 3, "world_size": world, "lora": True, "ema": False, "files": {},
            "config": to_dict(cfg)}


def test_valid_world_sizes_are_the_layouts_the_batch_arithmetic_accepts(tmp_path):
    assert valid_world_sizes(_cfg(tmp_path)) == [1, 2, 4, 8]
    # 4 images per rank per micro-batch: 8 images split into whole micro-batches only on 1 or 2 processes
    assert valid_world_sizes(_cfg(tmp_path, "batch.micro_batch_size=4")) == [1, 2]


def test_another_world_size_is_accepted_where_the_batch_splits(tmp_path):
    cfg = _cfg(tmp_path)
    for world in (1, 2, 4, 8):
        compat.check_compatible(tmp_path, _meta(cfg, 2), cfg, world)


def test_a_world_size_the_batch_does_not_split_over_is_refused_naming_the_valid_ones(tmp_path):
    cfg = _cfg(tmp_path)
    with pytest.raises(ConfigError) as e:
        compat.check_compatible(tmp_path / "step_00000003", _meta(cfg, 2), cfg, 3)
    line = str(e.value)
    assert line.startswith("checkpoint.resume: ") and "\n" not in line
    assert "written by 2 processes" in line and "does not split over 3" in line
    assert line.endswith("relaunch on 1, 2, 4 or 8 processes")


def test_another_preset_is_still_refused_first(tmp_path):
    cfg = _cfg(tmp_path)
    saved = _meta(_cfg(tmp_path, "sampling.group_size=8"), 2)
    with pytest.raises(ConfigError, match="belongs to another preset: sampling.group_size=8"):
        compat.check_compatible(tmp_path, saved, cfg, 3)


def test_an_optimizer_on_nvme_is_refused_on_another_world_size_only(tmp_path):
    ds = tmp_path / "nvme.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}))
    cfg = _cfg(tmp_path, f"deepspeed.config={ds}")
    compat.check_compatible(tmp_path, _meta(cfg, 2), cfg, 2)
    with pytest.raises(ConfigError, match="offloads the optimizer to NVMe.*relaunch on 2 processes"):
        compat.check_compatible(tmp_path, _meta(cfg, 2), cfg, 1)


def test_the_start_up_checks_refuse_before_touching_output_dir(tmp_path):
    """resume=auto on 3 processes with a 2-process checkpoint: the line is the checkpoint's (the batch is fixed by
    it, so the fix is the process count), not the batch arithmetic's, and output_dir stays as it was."""
    cfg = _cfg(tmp_path, "checkpoint.resume=auto")
    path = Path(cfg.output_dir) / "checkpoints" / ckpt.checkpoint_name(3)
    path.mkdir(parents=True)
    (path / ckpt.META).write_text(json.dumps(_meta(cfg, 2)))
    before = snapshot(Path(cfg.output_dir))
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, 3)
    assert str(e.value).startswith(f"checkpoint.resume: {path} was written by 2 processes")
    assert "relaunch on 1, 2, 4 or 8 processes" in str(e.value)
    assert snapshot(Path(cfg.output_dir)) == before
    # a fresh start on 3 keeps the batch arithmetic's own line: there the batch is the thing to change
    fresh = _cfg(tmp_path / "fresh")
    with pytest.raises(ConfigError, match="^batch.prompts_per_step: .* do not split over 3 processes"):
        check_inputs(fresh, 3)


def test_engine_config_switches_on_universal_loading_only_for_another_world_size(tmp_path):
    path = tmp_path / ckpt.checkpoint_name(3)
    path.mkdir()
    (path / ckpt.META).write_text(json.dumps({"format": ckpt.FORMAT, "world_size": 2, "files": {}}))
    ds = {"zero_optimization": {"stage": 3}, "checkpoint": {"tag_validation": "Warn"}}
    assert ckpt.engine_config(ds, None, 1) is ds
    assert ckpt.engine_config(ds, path, 2) is ds
    got = ckpt.engine_config(ds, path, 1)
    assert got["checkpoint"] == {"tag_validation": "Warn", "load_universal": True}
    assert "load_universal" not in ds["checkpoint"]  # the run's own config is not changed


class _Param:
    def __init__(self, numel: int):
        self.ds_numel = numel


def _sharded(params: dict[str, torch.Tensor], world: int, rank: int, prefix: str) -> ShardedEMA:
    """A ShardedEMA as rank `rank` of `world` holds it (zeros), without DeepSpeed: ZeRO-3's shard length."""
    ema = ShardedEMA.__new__(ShardedEMA)
    ema.prefix, ema.decay = prefix, 0.0
    ema.params = {n: _Param(p.numel()) for n, p in params.items()}
    ema.shadow = {n: torch.zeros(-(-p.numel() // world)) for n, p in params.items()}
    return ema


@pytest.mark.parametrize("written,now", [(2, 1), (1, 2), (2, 3), (3, 2), (4, 8), (8, 3)])
@pytest.mark.parametrize("prefix", ["ema/", "lag/"])
def test_average_shards_are_recut_for_the_new_ranks(tmp_path, monkeypatch, written, now, prefix):
    """Each new rank gets exactly the slice ZeRO-3 gives it of the flattened parameter, zero past its end, whatever
    the writer's ranks held (their padding is garbage on purpose)."""
    g = torch.Generator().manual_seed(0)
    params = {"a.weight": torch.randn(5, 7, generator=g), "b.bias": torch.randn(3, generator=g),
              "c": torch.randn(2, 2, 2, generator=g), "one": torch.randn(1, generator=g)}
    files = []
    for q in range(written):
        tensors = {}
        for name, p in params.items():
            m = -(-p.numel() // written)
            flat = torch.cat([p.flatten(), torch.full((m * written - p.numel(),), float("nan"))])
            tensors[prefix + name] = flat[q * m:(q + 1) * m].clone()
        files.append(tmp_path / ckpt.rank_file(q))
        save_file(tensors, str(files[-1]))
    for r in range(now):
        monkeypatch.setattr("grpo.ema.dist.is_initialized", lambda: True)
        monkeypatch.setattr("grpo.ema.dist.get_rank", lambda r=r: r)
        ema = _sharded(params, now, r, prefix)
        ema.load_resharded(files)
        for name, p in params.items():
            n = ema.shadow[name].numel()
            want = torch.cat([p.flatten(), torch.zeros(n * now - p.numel())])[r * n:(r + 1) * n]
            assert torch.equal(ema.shadow[name], want), (name, r)


def _checkpointer(tmp_path: Path, world: int = 1) -> ckpt.Checkpointer:
    cfg = SimpleNamespace(output_dir=str(tmp_path / "run"), checkpoint=SimpleNamespace(keep=2))
    return ckpt.Checkpointer(cfg, 0, world)


def _source(tmp_path: Path, world: int = 2) -> Path:
    path = tmp_path / "old" / "checkpoints" / ckpt.checkpoint_name(4)
    path.mkdir(parents=True)
    (path / ckpt.META).write_text(json.dumps({"format": ckpt.FORMAT, "step": 4, "world_size": world, "files": {}}))
    return path


def test_conversion_goes_next_to_the_run_and_is_reused_for_the_same_checkpoint(tmp_path, monkeypatch):
    source = _source(tmp_path)
    before = snapshot(source.parent)
    calls = []

    def fake_ds_to_universal(cmd, **kwargs):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--output_folder") + 1])
        (out / "zero").mkdir(parents=True)
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(universal.subprocess, "run", fake_ds_to_universal)
    c = _checkpointer(tmp_path)
    c.root.mkdir(parents=True)
    folder = universal.converted(c.root, source, c.world, c.rank)
    assert folder == c.root / f".universal-{source.name}" and (folder / source.name / "zero").is_dir()
    assert calls and calls[0][1:3] == ["-m", "deepspeed.checkpoint.ds_to_universal"]
    again = universal.converted(c.root, source, c.world, c.rank)
    assert again == folder and len(calls) == 1  # a rerun on the same count converts nothing
    assert snapshot(source.parent) == before  # the source checkpoint (and its run) are untouched
    (source / ckpt.META).write_text((source / ckpt.META).read_text() + " ")  # another checkpoint of that step
    universal.converted(c.root, source, c.world, c.rank)
    assert len(calls) == 2


def test_a_failed_conversion_names_its_log_and_leaves_no_usable_folder(tmp_path, monkeypatch):
    source = _source(tmp_path)
    monkeypatch.setattr(universal.subprocess, "run", lambda cmd, stdout, **kw: (stdout.write("boom\n"),
                                                                           SimpleNamespace(returncode=1))[1])
    c = _checkpointer(tmp_path)
    c.root.mkdir(parents=True)
    with pytest.raises(RuntimeError, match=r"ds_to_universal failed on .*\(exit 1\).*convert.log"):
        universal.converted(c.root, source, c.world, c.rank)
    assert not (c.root / f".universal-{source.name}").exists()


def test_the_next_complete_save_deletes_conversions(tmp_path):
    c = _checkpointer(tmp_path)
    for name in (".universal-step_00000004", ".tmp.universal-step_00000004", ckpt.checkpoint_name(5)):
        (c.root / name).mkdir(parents=True)
    c._prune()
    assert [p.name for p in c.root.iterdir()] == [ckpt.checkpoint_name(5)]


def test_a_conversion_that_cannot_fit_is_refused_before_it_starts(tmp_path, monkeypatch):
    """Free space under output_dir/checkpoints below twice the source checkpoint's size (ds_to_universal's peak):
    one line naming the folder, the sizes and the fixes (exit 1, an OutsideFailure), ds_to_universal never started
    and nothing made; with the space free the conversion goes ahead. A new output_dir is measured on its parent."""
    from grpo.errors import OutsideFailure

    source = _source(tmp_path)
    meta = json.loads((source / ckpt.META).read_text())
    meta["files"] = {"zero_pp_rank_0_mp_rank_00_optim_states.pt": [3 << 20, "0" * 64],
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt": [3 << 20, "0" * 64]}  # 6 MiB
    (source / ckpt.META).write_text(json.dumps(meta))
    calls, asked = [], []
    monkeypatch.setattr(universal.subprocess, "run",
                        lambda cmd, **kw: (calls.append(cmd), SimpleNamespace(returncode=1))[1])

    def disk_usage(path):
        asked.append(Path(path))
        return SimpleNamespace(total=1 << 30, used=0, free=free)

    monkeypatch.setattr(universal.shutil, "disk_usage", disk_usage)
    c = _checkpointer(tmp_path)
    free = 11 << 20  # 11 MiB < 12 MiB needed
    with pytest.raises(OutsideFailure) as e:
        universal.converted(c.root, source, c.world, c.rank)
    line = str(e.value)
    assert line == (f"checkpoint.resume: converting {source} (written by 2 processes) for this run's 1 needs about "
                    f"12.0 MiB free under {c.root} (2 x the checkpoint: DeepSpeed's ds_to_universal), 11.0 MiB free; "
                    "free space there or move output_dir to a larger disk and rerun, or resume on 2 processes, which "
                    "needs no conversion")
    assert e.value.code == 1 and calls == [] and not c.root.exists()
    assert asked == [tmp_path]  # output_dir does not exist yet: the disk it will be made on
    free = 12 << 20
    with pytest.raises(RuntimeError, match="ds_to_universal failed"):  # past the check: the stand-in fails
        universal.converted(c.root, source, c.world, c.rank)
    assert len(calls) == 1
