"""Fast checks (no launch) of the pieces behind resume, EMA export, metrics on resume, health and security."""

from __future__ import annotations

import ast
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo import checkpoint as ckpt
from grpo.checkpoint import files as ckpt_files
from grpo.checkpoint import damage as ckpt_damage
from grpo import compat
from grpo import health, rng
from grpo.config import load_config, to_dict
from grpo.ema import PREFIX, assemble
from grpo.errors import ConfigError
from grpo.metrics import MetricsLogger
from tests import ROOT

LORA = ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml"


def _checkpoint(root: Path, step: int, files: dict[str, bytes]) -> Path:
    path = root / ckpt.checkpoint_name(step)
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    meta = {"format": ckpt.FORMAT, "step": step, "world_size": 2, "lora": True, "ema": False, "config": {},
            "files": {n: [len(d), ckpt_damage._sha256(path / n)] for n, d in files.items()}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_verify_detects_truncation_corruption_and_missing_files(tmp_path):
    files = {f"zero_pp_rank_{r}_optim_states.pt": bytes(range(256)) * (r + 3) for r in range(2)}
    good = _checkpoint(tmp_path, 2, files)
    assert ckpt.verify(good) is None
    truncated = _checkpoint(tmp_path, 3, files)
    f = truncated / "zero_pp_rank_1_optim_states.pt"
    f.write_bytes(f.read_bytes()[:-10])
    assert "truncated" in ckpt.verify(truncated)
    flipped = _checkpoint(tmp_path, 4, files)
    f = flipped / "zero_pp_rank_0_optim_states.pt"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    assert "corrupted" in ckpt.verify(flipped)
    missing = _checkpoint(tmp_path, 5, files)
    (missing / "zero_pp_rank_0_optim_states.pt").unlink()
    assert "missing" in ckpt.verify(missing)
    no_meta = _checkpoint(tmp_path, 6, files)
    (no_meta / "meta.json").write_text("{")
    assert "meta.json" in ckpt.verify(no_meta)
    (tmp_path / ".tmp-step_00000007").mkdir()  # a save in progress is never a candidate
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [ckpt.checkpoint_name(s) for s in (6, 5, 4, 3, 2)]
    assert ckpt.newest_valid(tmp_path) == good


def test_rank_shares_cover_every_file_once():
    names = [f"f{i}" for i in range(11)]
    for world in (1, 2, 3, 8):
        shares = [ckpt_damage._share(names, r, world) for r in range(world)]
        assert sorted(n for s in shares for n in s) == sorted(names)


def test_resume_refuses_other_presets_but_not_run_control_settings(tmp_path):
    base = to_dict(load_config(LORA))
    same = to_dict(load_config(LORA, ["max_steps=99", "output_dir=/x", "checkpoint.every=3", "logging.eval_every=1",
                                      "faults.comm_timeout_s=60", "ema.decay=0.9", "data.cache_dir=/c"]))
    assert compat.config_differences(base, same) == []
    other = to_dict(load_config(LORA, ["optim.lr=1e-2", "sampling.num_steps=7"]))
    diff = compat.config_differences(base, other)
    assert [d.split("=")[0] for d in diff] == ["optim.lr", "sampling.num_steps"]
    relative = to_dict(load_config(LORA, ["model.path=assets/tiny-flux"]))
    absolute = to_dict(load_config(LORA, [f"model.path={ROOT / 'assets' / 'tiny-flux'}"]))
    if (ROOT / "assets" / "tiny-flux").exists() and Path("assets/tiny-flux").exists():
        assert compat.config_differences(relative, absolute) == []


def test_rng_state_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    tensors, meta = rng.rng_state(None)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    rng.set_rng_state(tensors, meta, None)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    from safetensors.torch import load_file, save_file

    save_file(tensors, "/tmp/_grpo_rng_test.safetensors", metadata=meta)  # safetensors-ready: tensors + str metadata
    assert set(load_file("/tmp/_grpo_rng_test.safetensors")) == set(tensors)
    Path("/tmp/_grpo_rng_test.safetensors").unlink()


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ema_shards_reassemble_like_zero3_partitions(world):
    """ZeRO-3 pads a flattened parameter to a multiple of the world size; rank r holds the r-th equal slice."""
    params = {"a.weight": torch.randn(5, 7), "b.bias": torch.randn(3), "c": torch.randn(2, 2, 2)}
    shards = [{} for _ in range(world)]
    shapes = {}
    for name, p in params.items():
        size = -(-p.numel() // world)
        flat = torch.cat([p.flatten(), torch.full((size * world - p.numel(),), float("nan"))])
        for r in range(world):
            shards[r][PREFIX + name] = flat[r * size:(r + 1) * size]
        shapes[name] = [list(p.shape), p.numel()]
    out = assemble(shards, shapes)
    for name, p in params.items():
        assert torch.equal(out[name], p)


def test_metrics_on_resume_drop_the_lost_part_of_the_run(tmp_path):
    rows = [{"step": 0, "eval/reward_mean": 0.1}, {"step": 0, "reward_mean": 0.2}, {"step": 1, "reward_mean": 0.3},
            {"step": 2, "eval/reward_mean": 0.4}, {"step": 2, "reward_mean": 0.5}, {"step": 3, "reward_mean": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = MetricsLogger(tmp_path, True, tensorboard=False, resume_step=2)
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:4]  # steps 0-1 and the eval after 2 steps; steps 2-3 are redone
    logger.log(2, {"reward_mean": 0.5, "reward_std": 0.1})
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    fresh = MetricsLogger(tmp_path, True, tensorboard=False, resume_step=None)  # auto found no checkpoint
    assert (tmp_path / "metrics.jsonl").read_text() == "" and fresh.rows == []


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume_and_only_the_last(tmp_path):
    """A rank 0 killed while appending a row leaves half a line; the resumed run drops it (its step is redone)."""
    rows = [{"step": 0, "reward_mean": 0.2}, {"step": 1, "reward_mean": 0.3}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "rew')
    assert MetricsLogger(tmp_path, True, tensorboard=False, resume_step=2).rows == rows
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text('{"step": 0, "rew\n' + json.dumps(rows[1]) + "\n")  # not a torn write: refused
    with pytest.raises(json.JSONDecodeError):
        MetricsLogger(tmp_path, True, tensorboard=False, resume_step=2)


def test_the_reward_curve_is_drawn_at_the_eval_and_sample_cadence_and_on_close(tmp_path, monkeypatch):
    """Not every step (a draw costs more than a tiny step): after eval rows, every logging.sample_every steps, and
    once more on close when rows came since the last draw."""
    from grpo import metrics

    drawn = []
    monkeypatch.setattr(metrics, "plot_reward_curve", lambda rows, path: drawn.append(rows[-1]["step"]))
    logger = MetricsLogger(tmp_path, True, tensorboard=False, config={"logging": {"sample_every": 3}})
    logger.log(0, {"eval/reward_mean": 0.1})
    for step in range(5):
        logger.log(step, {"reward_mean": 0.2})
    logger.log(5, {"eval/reward_mean": 0.3})
    logger.log(5, {"reward_mean": 0.4})
    assert drawn == [0, 0, 3, 5]  # the eval before step 0, steps 0 and 3, the eval after 5 steps
    logger.close()
    logger.close()  # nothing new since: no second draw
    assert drawn == [0, 0, 3, 5, 5]
    assert MetricsLogger(tmp_path / "b", True, tensorboard=False, config={"logging": {"sample_every": 0}}).curve_every == 0
    assert MetricsLogger(tmp_path / "c", True, tensorboard=False).curve_every == 1  # no config: every step, as before


def test_skip_counter_and_fault_injection(monkeypatch):
    c = health.SkipCounter(limit=2)
    assert [c.record(s) for s in (True, False, True, True)] == [False, False, False, True]
    assert (c.consecutive, c.total) == (2, 3)
    from tests.recipe.faulty_recipe import FAULT_ENV, inject  # the fault tests' recipe (tests/recipe/test_faults.py)

    monkeypatch.setenv(FAULT_ENV, "nan_reward@2,nan_loss@3:1")
    x = torch.ones(3, requires_grad=True)
    assert torch.isnan(inject("nan_reward", 2, 0, x)).all()
    assert torch.equal(inject("nan_reward", 1, 0, x), x)
    assert torch.equal(inject("nan_loss", 3, 0, x), x) and torch.isnan(inject("nan_loss", 3, 1, x)).all()
    monkeypatch.delenv(FAULT_ENV)
    line = health.health_line(4, {"reward_mean": 0.5, "loss": 1e-6, "ratio_max_dev": 0.0, "clip_frac": 0.0,
                                  "grad_norm": float("inf"), "kl": 0.0, "nonfinite/tiny_world": 4.0,
                                  "nonfinite/loss": 1.0, "skipped_updates": 1.0, "step_time_s": 2.0})
    assert "\n" not in line and "grad_norm inf" in line and "nonfinite reward/loss/grad 4/1/0" in line


def test_security_no_unsafe_loads_and_no_remote_code():
    """torch.load only with weights_only=True (DeepSpeed's own checkpoint loader is the documented exception)."""
    sources = [*ROOT.glob("grpo/**/*.py"), *ROOT.glob("recipes/**/*.py")]
    for f in sources:
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if name == "torch.load":
                assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, \
                    f"{f}:{node.lineno}"
            assert name not in ("pickle.load", "pickle.loads"), f"{f}:{node.lineno}"
            remote = kw.get("trust_remote_code")
            assert not (isinstance(remote, ast.Constant) and remote.value is True), f"{f}:{node.lineno}"


def test_resume_auto_with_every_checkpoint_damaged_stops_instead_of_restarting(tmp_path):
    """All checkpoints corrupted: moved aside, and exit 2 (no silent restart from step 0), also on the next try."""
    cfg = load_config(str(LORA), [f"output_dir={tmp_path}", "checkpoint.resume=auto"])
    bad = _checkpoint(tmp_path / "checkpoints", 2, {"zero_pp_rank_0_optim_states.pt": b"x" * 64})
    (bad / "zero_pp_rank_0_optim_states.pt").write_bytes(b"y" * 64)  # same size, other content
    assert ckpt.newest_valid(tmp_path / "checkpoints", check=ckpt.structure) == bad  # start-up checks do not hash
    for _ in range(2):
        with pytest.raises(ConfigError, match="only damaged ones .*checkpoint.resume=null"):
            ckpt.resume_point(cfg, 2)
    assert [p.name.startswith(".invalid-step_00000002") for p in (tmp_path / "checkpoints").iterdir()] == [True]


def test_health_line_warns_when_the_ratio_drifts_from_one():
    stats = {"reward_mean": 0.5, "loss": 0.1, "ratio_max_dev": 2e-5, "clip_frac": 0.0, "step_time_s": 1.0}
    quiet = health.health_line(1, stats, clip_range=1e-3)
    assert "WARNING" not in quiet and quiet == health.health_line(1, stats)  # the line is unchanged below the bound
    line = health.health_line(1, stats, clip_range=1e-4)
    assert line.startswith(quiet + " | ") and "\n" not in line
    assert "WARNING ratio_max_dev 2.00e-05 exceeds 10% of clip_range 1.00e-04" in line
    assert "WARNING" not in health.health_line(1, {**stats, "ratio_max_dev": None}, clip_range=1e-4)
    per_step = {**stats, "ratio_dev/t00_max": 1e-6, "ratio_dev/t00_mean": 5e-7, "ratio_dev/t07_max": 2e-5,
                "ratio_dev/t07_mean": 4e-6}
    assert ("WARNING ratio_max_dev 2.00e-05 at transition 7 (mean 4.00e-06 there) exceeds 10% of clip_range"
            in health.health_line(1, per_step, clip_range=1e-4))


def test_the_recipe_refuses_before_moving_anything_and_sets_aside_after_the_lock(tmp_path):
    """resume_point(move_aside=False), the recipe's (before output_dir/.lock): it verifies and refuses, but moves
    nothing; set_aside_newer, after the lock, moves exactly the newer invalid ones aside."""
    cfg = load_config(str(LORA), [f"output_dir={tmp_path}", "checkpoint.resume=auto"])
    root = tmp_path / "checkpoints"
    bad = _checkpoint(root, 2, {"zero_pp_rank_0_optim_states.pt": b"x" * 64})
    (bad / "zero_pp_rank_0_optim_states.pt").write_bytes(b"y" * 64)
    with pytest.raises(ConfigError, match="only damaged ones \\(1\\); resuming"):
        ckpt.resume_point(cfg, 2, move_aside=False)
    assert [p.name for p in root.iterdir()] == [bad.name]
    good = _checkpoint(root, 1, {"zero_pp_rank_0_optim_states.pt": b"x" * 64})
    meta = json.loads((good / "meta.json").read_text())
    (good / "meta.json").write_text(json.dumps({**meta, "config": to_dict(cfg)}))  # the same preset: compatible
    assert ckpt.resume_point(cfg, 2, move_aside=False) == good
    assert sorted(p.name for p in root.iterdir()) == [good.name, bad.name]
    ckpt.set_aside_newer(cfg, good)
    assert sorted(p.name[:22] for p in root.iterdir()) == [".invalid-step_00000002", good.name]


def test_a_write_the_file_system_refuses_during_a_save_is_one_line_naming_the_path_and_errno(tmp_path, monkeypatch):
    """Python's writers carry the errno; torch.save's C++ writer does not ("Parent directory ... does not exist"),
    so a probe file asks the file system; any other error, or one on a writable disk, stays what it was."""
    import errno
    import tempfile

    from grpo.errors import OutsideFailure

    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ckpt.LATEST).write_text(ckpt.checkpoint_name(1))
    name = ckpt.checkpoint_name(2)
    f = root / f".tmp-{name}" / "meta.json"
    with pytest.raises(OutsideFailure) as e, ckpt_files._disk_full(root, name):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(f))
    line = str(e.value)
    assert line.startswith(f"output_dir: cannot write {f} (checkpoint {name}): Read-only file system (EROFS); "
                           f"the previous checkpoint {root / ckpt.checkpoint_name(1)} is intact.")
    assert line.endswith("then rerun with checkpoint.resume=auto") and "\n" not in line and e.value.code == 1
    torch_says = RuntimeError(f"Parent directory {f.parent} does not exist.")
    with pytest.raises(RuntimeError, match="Parent directory"), ckpt_files._disk_full(root, name):
        raise torch_says  # the disk takes a probe file: not the file system's doing
    with pytest.raises(ValueError), ckpt_files._disk_full(root, name):
        raise ValueError("not a write")

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root / "tmpXYZ"))

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    with pytest.raises(OutsideFailure) as e, ckpt_files._disk_full(root, name):
        raise torch_says
    assert str(e.value).startswith(f"output_dir: cannot write {root} (checkpoint {name}): Permission denied (EACCES)")
