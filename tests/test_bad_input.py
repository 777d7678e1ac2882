"""Bad input: every case exits with code 2 and one line `error: <setting>: ...; <fix>`, before any model is loaded
(the recipe's setup() is never reached), and leaves output_dir exactly as it was.

All cases run through the recipe's own main() in one driver process (tests/bad_input_driver.py), so 30+ cases cost
one import of torch and DeepSpeed; one case also runs as a real `python recipes/flux_grpo.py` process. The launch
scripts get the same exit code and line from their own check (python -m grpo.config) before any rank starts, and a
LoRA target that matches no module fails once the model is built, before output_dir is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY

LORA = str(ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml")


def _tree(path: Path) -> dict | None:
    """Everything under `path` (names, sizes, mtimes, contents of small files); None if it does not exist."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
            for p in sorted(path.rglob("*"))}


def _fake_checkpoint(path: Path, world_size: int, config_overrides: list[str]) -> Path:
    """A checkpoint folder with a valid (empty) file list and the resolved config of LORA + overrides."""
    from grpo.checkpoint import FORMAT
    from grpo.config import load_config, to_dict

    path.mkdir(parents=True)
    meta = {"format": FORMAT, "step": 3, "world_size": world_size, "files": {}, "lora": True, "ema": False,
            "config": to_dict(load_config(LORA, config_overrides))}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def _cases(tmp: Path) -> list[dict]:
    """(name, extra argv, setting named first in the error)."""
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("max_steps: [1, 2\n")
    list_yaml = tmp / "list.yaml"
    list_yaml.write_text("- max_steps\n- 3\n")
    empty_prompts = tmp / "empty.txt"
    empty_prompts.write_text("# only a comment\n\n")
    binary_prompts = tmp / "binary.txt"
    binary_prompts.write_bytes(b"\x00\x01\x02 a red circle\n")
    latin1_prompts = tmp / "latin1.txt"
    latin1_prompts.write_bytes("a caf\xe9 on a red background\n".encode("latin-1"))
    no_index = tmp / "not_a_model"
    no_index.mkdir()
    ds_stage2 = tmp / "ds2.json"
    ds_stage2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    ds_batch = tmp / "ds_batch.json"
    ds_batch.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 8}))
    ds_garbled = tmp / "ds_garbled.json"
    ds_garbled.write_text("{\"zero_optimization\": {\"stage\": 3,,}")
    other_world = _fake_checkpoint(tmp / "ckpt_world4" / "step_00000003", 4, [])
    other_preset = _fake_checkpoint(tmp / "ckpt_g8" / "step_00000003", 1, ["sampling.group_size=8"])
    garbled_ckpt = tmp / "ckpt_garbled" / "step_00000003"
    garbled_ckpt.mkdir(parents=True)
    (garbled_ckpt / "meta.json").write_text("{not json")
    cases = [
        ("malformed YAML", ["--config", str(bad_yaml)], "config"),
        ("missing config", ["--config", str(tmp / "nope.yaml")], "config"),
        ("config not a mapping", ["--config", str(list_yaml)], "config"),
        ("unknown key", ["bogus=1"], "bogus"),
        ("unknown nested key", ["sampling.colour=red"], "sampling.colour"),
        ("wrong type (int)", ["max_steps=ten"], "max_steps"),
        ("wrong type (bool)", ["logging.tensorboard=maybe"], "logging.tensorboard"),
        ("wrong type (section)", ["sampling=3"], "sampling"),
        ("malformed override", ["noequals"], "override"),
        ("impossible batch arithmetic", ["batch.micro_batch_size=3"], "batch.micro_batch_size"),
        ("group of one", ["sampling.group_size=1"], "sampling.group_size"),
        ("deterministic rollouts", ["sampling.eta=0"], "sampling.eta"),
        ("resolution not a multiple of 16", ["sampling.resolution=60"], "sampling.resolution"),
        ("missing model path", ["model.path=/nonexistent/flux-model"], "model.path"),
        ("model folder without model_index.json", [f"model.path={no_index}"], "model.path"),
        ("missing reward model file", ["rewards={hpsv2: {weight: 1.0, repo: /nonexistent/hps}}"], "rewards.hpsv2.repo"),
        ("unknown reward", ["rewards={beauty: 1.0}"], "rewards.beauty"),
        ("missing prompt file", [f"data.train_prompts={tmp / 'nope.txt'}"], "data.train_prompts"),
        ("empty prompt file", [f"data.train_prompts={empty_prompts}"], "data.train_prompts"),
        ("binary prompt file", [f"data.train_prompts={binary_prompts}"], "data.train_prompts"),
        ("non-UTF-8 prompt file", [f"data.eval_prompts={latin1_prompts}"], "data.eval_prompts"),
        ("missing deepspeed config", [f"deepspeed.config={tmp / 'nope.json'}"], "deepspeed.config"),
        ("garbled deepspeed config", [f"deepspeed.config={ds_garbled}"], "deepspeed.config"),
        ("ZeRO stage 2", [f"deepspeed.config={ds_stage2}"], "deepspeed.config"),
        ("batch size set in deepspeed config", [f"deepspeed.config={ds_batch}"], "deepspeed.config"),
        ("non-empty output_dir without resume", [], "output_dir"),
        ("resume path missing", [f"checkpoint.resume={tmp / 'no_such_ckpt'}"], "checkpoint.resume"),
        ("resume from another world size", [f"checkpoint.resume={other_world}"], "checkpoint.resume"),
        ("resume from another preset", [f"checkpoint.resume={other_preset}"], "checkpoint.resume"),
        ("resume from a garbled checkpoint", [f"checkpoint.resume={garbled_ckpt}"], "checkpoint.resume"),
        ("keep no checkpoint", ["checkpoint.keep=0"], "checkpoint.keep"),
        ("EMA decay out of range", ["ema.decay=1.5"], "ema.decay"),
        ("zero comm timeout", ["faults.comm_timeout_s=0"], "faults.comm_timeout_s"),
        ("zero skip limit", ["faults.max_consecutive_skips=0"], "faults.max_consecutive_skips"),
        ("wandb not installed", ["logging.wandb=true"], "logging.wandb"),
        ("unknown dtype", ["model.dtype=fp64"], "model.dtype"),
        ("empty LoRA targets", ["lora.target_modules=[]"], "lora.target_modules"),
    ]
    out = []
    for i, (name, argv, setting) in enumerate(cases):
        run_dir = tmp / f"out{i}"
        if name.startswith("non-empty output_dir"):
            run_dir.mkdir()
            (run_dir / "notes.txt").write_text("an earlier run's file\n")
        if "--config" not in argv:
            argv = ["--config", LORA, *argv]
        argv = [*argv, f"output_dir={run_dir}", f"data.cache_dir={tmp / 'cache'}", f"model.path={TINY}"] \
            if not any(a.startswith("model.path=") for a in argv) else [*argv, f"output_dir={run_dir}",
                                                                         f"data.cache_dir={tmp / 'cache'}"]
        out.append({"name": name, "argv": argv, "setting": setting, "out": str(run_dir)})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    cases = _cases(tmp)
    before = {c["name"]: _tree(Path(c["out"])) for c in cases}
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "bad_input_driver.py"), str(tmp / "cases.json"),
                           str(tmp / "results.json")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r["name"]: r for r in json.loads((tmp / "results.json").read_text())}
    return [(c, got[c["name"]], before[c["name"]], _tree(Path(c["out"]))) for c in cases]


def test_at_least_twenty_cases(results):
    assert len(results) >= 20


def test_each_bad_input_exits_2_with_one_line_naming_the_setting(results):
    failures = []
    for case, res, _, _ in results:
        lines = res["stderr"].strip().splitlines()  # third-party import warnings may come first
        errors = [line for line in lines if line.startswith("error:")]
        ok = (res["rc"] == 2 and len(errors) == 1 and lines[-1] == errors[0]
              and errors[0].startswith(f"error: {case['setting']}") and len(errors[0]) < 400)
        if not ok:
            failures.append(f"{case['name']}: rc={res['rc']!r} stderr={res['stderr'][-400:]!r}")
    assert not failures, "\n".join(failures)


def test_output_dir_is_left_untouched(results):
    changed = [case["name"] for case, _, before, after in results if before != after]
    assert not changed


def test_messages_say_how_to_fix_it(results):
    """Spot checks that the line carries the fix, not just the complaint."""
    by_name = {case["name"]: res["stderr"].strip().splitlines()[-1] for case, res, _, _ in results}
    assert "checkpoint.resume=auto" in by_name["non-empty output_dir without resume"]
    assert "relaunch on 4 processes" in by_name["resume from another world size"]
    assert "sampling.group_size=8 in the checkpoint, 4 now" in by_name["resume from another preset"]
    assert "hf download" in by_name["missing reward model file"]
    assert "valid keys under sampling" in by_name["unknown nested key"]
    assert "not valid YAML (line " in by_name["malformed YAML"]


def test_real_process_exits_2(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "flux_grpo.py"), "--config", LORA,
                           f"output_dir={out}", f"model.path={TINY}"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: output_dir:")
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC", "NNODES", "NODE_RANK"):
        env.pop(k, None)
    return env


def _one_error_line(stderr: str) -> str:
    """The error line, after asserting it is the only one and the last (DeepSpeed's accelerator notice may precede)."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("case", ["unknown key", "batch arithmetic of NPROC=3", "hostfile of 3 slots",
                                  "missing model folder", "missing deepspeed config"])
def test_launch_scripts_exit_2_before_torchrun(tmp_path, case):
    """The launchers run the recipe's start-up checks (grpo.inputs) before starting any rank: torchrun and the
    DeepSpeed launcher report a rank's exit code 2 as 1. 16 prompts x 4 images do not split over 3 processes."""
    out = tmp_path / "run"
    if case != "unknown key":
        out.mkdir()  # an existing empty output_dir stays empty
    env, args, setting = _env(), [f"output_dir={out}", f"model.path={TINY}"], "batch.prompts_per_step"
    if case == "unknown key":
        cmd, setting = ["bash", str(ROOT / "launch" / "run.sh"), LORA, "sampling.colour=red", *args], "sampling.colour"
    elif case == "batch arithmetic of NPROC=3":
        cmd, env["NPROC"] = ["bash", str(ROOT / "launch" / "run.sh"), LORA, *args], "3"
    elif case == "missing model folder":
        cmd = ["bash", str(ROOT / "launch" / "run.sh"), LORA, *args, f"model.path={tmp_path / 'no_model'}"]
        setting = "model.path"
    elif case == "missing deepspeed config":
        cmd = ["bash", str(ROOT / "launch" / "run.sh"), LORA, *args, f"deepspeed.config={tmp_path / 'no.json'}"]
        setting = "deepspeed.config"
    else:
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("# one node\nlocalhost slots=3\n")
        cmd = ["bash", str(ROOT / "launch" / "multinode.sh"), str(hostfile), LORA, *args]
    before = _tree(out)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _one_error_line(proc.stderr).startswith(f"error: {setting}:")
    assert "[launch]" not in proc.stderr  # no rank was started
    assert _tree(out) == before


def test_lora_target_matching_no_module_exits_2_and_writes_nothing(tmp_path):
    """Caught once the transformer is built (PEFT itself ignores an entry that matches nothing while others match);
    output_dir is written only after that, so an existing empty one stays empty."""
    out = tmp_path / "run"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "flux_grpo.py"), "--config", LORA,
                           "lora.target_modules=[to_q, no_such_module]", "max_steps=1", f"output_dir={out}",
                           f"model.path={TINY}", f"data.cache_dir={tmp_path / 'cache'}"],
                          env={**_env(), "DS_ACCELERATOR": "cpu"}, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_error_line(proc.stderr)
    assert line.startswith("error: lora.target_modules: 'no_such_module' matches no module")
    assert list(out.iterdir()) == []
