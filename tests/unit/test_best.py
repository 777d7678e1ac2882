"""The best held-out eval and the collapse alarm (grpo/best.py): which eval is kept, when the alarm fires, what a
checkpoint carries; and best/ put in place whole (grpo/export.py's publish)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from grpo import health
from grpo.best import Best, Drop, HeldOut, below_best, definition, paired
from grpo.checkpoint import Saved
from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.export import publish
from tests import ROOT

PRESET = ROOT / "recipes/configs/tiny/grpo_lora.yaml"


def held(step: int, scores: list[float]) -> HeldOut:
    return HeldOut(step, torch.tensor(scores, dtype=torch.float32))


def test_held_out_mean_and_standard_error_are_the_closed_forms():
    h = held(3, [0.2, 0.4, 0.9, 0.5])
    x = [0.2, 0.4, 0.9, 0.5]
    m = sum(x) / 4
    assert h.mean == pytest.approx(m, abs=1e-7)
    assert h.se == pytest.approx(math.sqrt(sum((v - m) ** 2 for v in x) / 3 / 4), rel=1e-6)
    assert held(0, [0.7]).se == 0.0


def test_the_first_eval_is_the_best_and_only_a_strictly_higher_mean_replaces_it():
    best = Best("d")
    assert best.drop(held(0, [0.5, 0.5])) is None  # nothing to compare with yet
    assert best.observe(held(0, [0.5, 0.5])) and best.held.step == 0  # step 0 (the base model) counts
    assert not best.observe(held(1, [0.4, 0.6]))  # the same mean: the earlier eval stays
    assert best.held.step == 0
    assert best.observe(held(2, [0.5, 0.6])) and best.held.step == 2
    assert not best.observe(held(3, [0.1, 0.2])) and best.held.step == 2


def test_the_drop_is_the_paired_difference_with_its_standard_error():
    best = Best("d")
    best.observe(held(0, [0.9, 0.5, 0.7, 0.3]))
    now = held(4, [0.8, 0.3, 0.7, 0.1])
    d = [b - a for a, b in zip([0.9, 0.5, 0.7, 0.3], [0.8, 0.3, 0.7, 0.1])]
    m = sum(d) / 4
    se = math.sqrt(sum((x - m) ** 2 for x in d) / 3 / 4)
    drop = best.drop(now)
    assert drop.mean == pytest.approx(m, abs=1e-6) and drop.se == pytest.approx(se, rel=1e-5)
    assert drop.sigmas == pytest.approx(-m / se, rel=1e-5)
    # paired is tools.compare's own
    from tools import compare
    assert compare.paired is paired


def test_the_alarm_fires_only_beyond_k_standard_errors_below_the_best():
    assert below_best(Drop(-0.31, 0.1), 3.0)
    assert not below_best(Drop(-0.29, 0.1), 3.0)
    assert not below_best(Drop(-0.30, 0.1), 3.0 + 1e-9)  # "more than" k
    assert not below_best(Drop(0.5, 0.1), 3.0)  # above the best
    assert below_best(Drop(-0.01, 0.0), 3.0)  # every image lower by the same amount: infinitely many errors
    assert not below_best(Drop(0.0, 0.0), 3.0)
    assert not below_best(Drop(-5.0, 1.0), float("inf"))


def test_pairing_sees_a_drop_that_the_spread_over_images_hides():
    """The images differ far more from one another than one eval from the next: unpaired, a uniform fall of 0.02 is
    a fraction of a standard error; paired it is many."""
    base = [0.1 * i for i in range(10)]
    best = Best("d")
    best.observe(held(0, base))
    now = held(5, [x - 0.02 + 0.001 * (i % 2) for i, x in enumerate(base)])
    assert 0.02 < best.held.se and below_best(best.drop(now), 3.0)


def test_the_alarm_line_names_the_eval_and_the_best():
    line = health.collapse_line(12, 0.81, 4, 0.88, 4.2, 3.0, stop=False)
    assert line.startswith("WARNING held-out collapse: the eval at step 12 (0.81)")
    assert "step 4 (0.88)" in line and "4.2 paired standard errors" in line and "\n" not in line
    assert "stopping here" in health.collapse_line(12, 0.81, 4, 0.88, 4.2, 3.0, stop=True)


def _saved(tensors: dict) -> Saved:
    return Saved(tensors=tensors, files=[], resharded=False, rank=0)


def test_the_best_travels_in_a_checkpoint_exactly():
    best = Best("d")
    assert best.state_dict() == ({}, {})  # no eval yet: nothing saved, a resumed run starts without a best
    best.observe(held(6, [0.123456789, 0.987654321, 0.5]))
    tensors, meta = best.state_dict()
    again = Best("d")
    again.load_state_dict(_saved(tensors))
    assert again.held.step == 6 and torch.equal(again.held.per_image, best.held.per_image)
    assert again.held.mean == best.held.mean and again.summary() == best.summary()
    # the same decisions afterwards
    nxt = held(7, [0.1, 0.9, 0.4])
    assert again.drop(nxt) == best.drop(nxt) and again.observe(nxt) == best.observe(nxt)
    fresh = Best("d")
    fresh.load_state_dict(_saved({}))  # a checkpoint from before the best was kept
    assert fresh.held is None


def test_another_eval_definition_starts_the_best_afresh():
    best = Best(definition(["a red square"], load_config(PRESET)))
    best.observe(held(2, [0.5, 0.6]))
    other = Best(definition(["a red square"], load_config(PRESET, ["logging.eval_seeds=3"])))
    other.load_state_dict(_saved(best.state_dict()[0]))
    assert other.held is None
    same = Best(definition(["a red square"], load_config(PRESET, ["logging.eval_every=7"])))  # evals as before
    same.load_state_dict(_saved(best.state_dict()[0]))
    assert same.held.step == 2


def test_collapse_alarm_setting_defaults_to_warn_and_is_checked():
    cfg = load_config(PRESET)
    assert cfg.logging.collapse_alarm.sigmas == 3.0 and cfg.logging.collapse_alarm.stop is False
    assert load_config(PRESET, ["logging.collapse_alarm=null"]).logging.collapse_alarm is None
    cfg = load_config(PRESET, ["logging.collapse_alarm.stop=true"])
    assert cfg.logging.collapse_alarm.stop is True and cfg.logging.collapse_alarm.sigmas == 3.0
    with pytest.raises(ConfigError, match="logging.collapse_alarm.sigmas: must be > 0"):
        load_config(PRESET, ["logging.collapse_alarm.sigmas=0"])


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def test_publish_replaces_the_folder_whole(tmp_path):
    final, tmp = tmp_path / "best", tmp_path / ".tmp-best"
    for folder, step in ((tmp, 1),):
        (folder / "lora").mkdir(parents=True)
        (folder / "lora" / "w.safetensors").write_text(f"weights {step}")
        (folder / "best.json").write_text(json.dumps({"step": step}))
    publish(tmp, final)
    assert _tree(final) == {"best.json": '{"step": 1}', "lora/w.safetensors": "weights 1"} and not tmp.exists()
    (tmp / "lora").mkdir(parents=True)
    (tmp / "lora" / "w.safetensors").write_text("weights 2")
    (tmp / "best.json").write_text(json.dumps({"step": 2}))
    publish(tmp, final)
    assert _tree(final) == {"best.json": '{"step": 2}', "lora/w.safetensors": "weights 2"}
    assert sorted(os.listdir(tmp_path)) == ["best"]  # nothing left beside it


def test_a_kill_between_the_renames_leaves_both_whole(tmp_path, monkeypatch):
    """The one moment best/ is absent: the old one is whole in .old-best, the new one whole in .tmp-best; the next
    publish puts the newer in place and removes the rest."""
    final, tmp = tmp_path / "best", tmp_path / ".tmp-best"
    final.mkdir()
    (final / "best.json").write_text("old")
    tmp.mkdir()
    (tmp / "best.json").write_text("new")
    real = Path.rename

    def killed(self, target):
        if self == tmp:
            raise KeyboardInterrupt  # the kill, after the old folder moved aside
        return real(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        publish(tmp, final)
    monkeypatch.setattr(Path, "rename", real)
    assert not final.exists()
    assert (tmp_path / ".old-best" / "best.json").read_text() == "old" and (tmp / "best.json").read_text() == "new"
    publish(tmp, final)
    assert _tree(final) == {"best.json": "new"} and sorted(os.listdir(tmp_path)) == ["best"]
