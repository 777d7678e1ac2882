"""Bad input: every case fails the recipe's start-up checks with one line `error: <setting>: ...; <fix>` (the line
the recipe prints before exiting with code 2), before any model is loaded, and leaves output_dir exactly as it was.

The cases run in this process through the checks the recipe runs before setup(): load_config (with validate),
grpo.inputs.check_inputs for world size 1, and the resume point. Real exit-code runs (launch/*.sh, a plain recipe
process, a LoRA target that fails on the built model) are in tests/recipe/test_bad_input_launch.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from grpo.checkpoint import resume_point
from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.inputs import check_inputs
from tests import ROOT, TINY, snapshot

LORA = str(ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml")


def _fake_checkpoint(path: Path, world_size: int, config_overrides: list[str], files: dict | None = None) -> Path:
    """A checkpoint folder with a valid (empty, or `files`) file list and the resolved config of LORA + overrides."""
    from grpo.checkpoint import FORMAT
    from grpo.config import load_config, to_dict

    path.mkdir(parents=True)
    meta = {"format": FORMAT, "step": 3, "world_size": world_size, "files": files or {}, "lora": True, "ema": False,
            "config": to_dict(load_config(LORA, config_overrides))}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def _cases(tmp: Path) -> list[dict]:
    """(name, extra argv, setting named first in the error)."""
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("max_steps: [1, 2\n")
    list_yaml = tmp / "list.yaml"
    list_yaml.write_text("- max_steps\n- 3\n")
    dup_yaml = tmp / "dup.yaml"  # the preset with output_dir given twice: PyYAML would keep the last silently
    dup_yaml.write_text(Path(LORA).read_text() + "output_dir: runs/dup\n")
    latin1_yaml = tmp / "latin1.yaml"
    latin1_yaml.write_bytes(Path(LORA).read_bytes() + "# caf\xe9\n".encode("latin-1"))
    empty_prompts = tmp / "empty.txt"
    empty_prompts.write_text("# only a comment\n\n")
    binary_prompts = tmp / "binary.txt"
    binary_prompts.write_bytes(b"\x00\x01\x02 a red circle\n")
    latin1_prompts = tmp / "latin1.txt"
    latin1_prompts.write_bytes("a caf\xe9 on a red background\n".encode("latin-1"))
    no_prompt_jsonl = tmp / "no_prompt.jsonl"
    no_prompt_jsonl.write_text('{"prompt": "a red circle on a blue background"}\n{"caption": "a cat"}\n')
    bad_image_jsonl = tmp / "bad_image.jsonl"
    (tmp / "broken.png").write_bytes(b"not a png")
    bad_image_jsonl.write_text('{"prompt": "a cat", "image": "broken.png"}\n')
    no_index = tmp / "not_a_model"
    no_index.mkdir()
    ds_stage2 = tmp / "ds2.json"
    ds_stage2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    ds_batch = tmp / "ds_batch.json"
    ds_batch.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 8}))
    ds_garbled = tmp / "ds_garbled.json"
    ds_garbled.write_text("{\"zero_optimization\": {\"stage\": 3,,}")
    # Another world size resumes (resharded), except with the optimizer on NVMe, which only its writer's ranks reload
    ds_nvme = tmp / "ds_nvme.json"
    ds_nvme.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                                           "nvme_path": str(tmp)}}}))
    other_world = _fake_checkpoint(tmp / "ckpt_world4" / "step_00000003", 4, [f"deepspeed.config={ds_nvme}"])
    other_preset = _fake_checkpoint(tmp / "ckpt_g8" / "step_00000003", 1, ["sampling.group_size=8"])
    garbled_ckpt = tmp / "ckpt_garbled" / "step_00000003"
    garbled_ckpt.mkdir(parents=True)
    (garbled_ckpt / "meta.json").write_text("{not json")
    not_ckpt = tmp / "some_folder"
    not_ckpt.mkdir()
    (not_ckpt / "notes.txt").write_text("not a checkpoint\n")
    missing_file = _fake_checkpoint(tmp / "ckpt_missing" / "step_00000003", 1, [],
                                    {"zero_pp_rank_0_mp_rank_00_model_states.pt": [10, "0" * 64]})
    a_file = tmp / "a_file"
    a_file.write_text("in the way\n")
    damaged_run = tmp / "damaged_run"
    (damaged_run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (damaged_run / "checkpoints" / "step_00000002" / "meta.json").write_text("{truncated")
    (damaged_run / "metrics.jsonl").write_text('{"step": 0}\n')
    locked = tmp / "locked_run"
    locked.mkdir()
    import socket

    from grpo.lock import _process_start

    # pid 1 runs on every machine: a live holder on this host
    (locked / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "pid_start": _process_start(1),
                                              "time": 0}))
    if os.geteuid() == 0:  # root writes through permission bits: a read-only file system instead
        unwritable = Path("/sys/grpo_run")
    else:
        ro = tmp / "read_only"
        ro.mkdir(mode=0o500)
        unwritable = ro / "run"
    cases = [
        ("malformed YAML", ["--config", str(bad_yaml)], "config"),
        ("missing config", ["--config", str(tmp / "nope.yaml")], "config"),
        ("config not a mapping", ["--config", str(list_yaml)], "config"),
        ("duplicate YAML key", ["--config", str(dup_yaml)], "config"),
        ("non-UTF-8 config", ["--config", str(latin1_yaml)], "config"),
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
        ("dataset row without a prompt", [f"data.train_prompts={no_prompt_jsonl}"], "data.train_prompts"),
        ("dataset row with an unreadable image", [f"data.eval_prompts={bad_image_jsonl}"], "data.eval_prompts"),
        ("metadata reward on a text file", ["rewards={tiny_world_meta: 1.0}"], "data.train_prompts"),
        ("missing deepspeed config", [f"deepspeed.config={tmp / 'nope.json'}"], "deepspeed.config"),
        ("garbled deepspeed config", [f"deepspeed.config={ds_garbled}"], "deepspeed.config"),
        ("ZeRO stage 2", [f"deepspeed.config={ds_stage2}"], "deepspeed.config"),
        ("batch size set in deepspeed config", [f"deepspeed.config={ds_batch}"], "deepspeed.config"),
        ("non-empty output_dir without resume", [], "output_dir"),
        ("resume path missing", [f"checkpoint.resume={tmp / 'no_such_ckpt'}"], "checkpoint.resume"),
        ("resume from another world size, optimizer on NVMe", [f"checkpoint.resume={other_world}",
                                                                f"deepspeed.config={ds_nvme}"], "checkpoint.resume"),
        ("resume from another preset", [f"checkpoint.resume={other_preset}"], "checkpoint.resume"),
        ("resume from a garbled checkpoint", [f"checkpoint.resume={garbled_ckpt}"], "checkpoint.resume"),
        # numbers: non-finite anywhere, then the ranges of betas, eps, eta, clip ranges and weights
        ("infinite learning rate", ["optim.lr=inf"], "optim.lr"),
        ("NaN eta", ["sampling.eta=nan"], "sampling.eta"),
        ("NaN advantage clip", ["advantage.clip=.nan"], "advantage.clip"),
        ("infinite reward weight", ["rewards={tiny_world: {weight: .inf}}"], "rewards.tiny_world.weight"),
        ("beta above 1", ["optim.betas=[1.5, 0.999]"], "optim.betas"),
        ("three betas", ["optim.betas=[0.9, 0.99, 0.999]"], "optim.betas"),
        ("zero AdamW eps", ["optim.eps=0"], "optim.eps"),
        ("negative weight decay", ["optim.weight_decay=-0.1"], "optim.weight_decay"),
        ("negative warm-up", ["optim.warmup_steps=-1"], "optim.warmup_steps"),
        ("fused AdamW not a boolean", ["optim.fused=maybe"], "optim.fused"),
        ("zero gradient clip", ["optim.max_grad_norm=0"], "optim.max_grad_norm"),
        ("negative eta", ["sampling.eta=-0.3"], "sampling.eta"),
        ("ratio clip range of 1", ["grpo.clip_range=1"], "grpo.clip_range"),
        ("zero ratio clip range", ["grpo.clip_range=0"], "grpo.clip_range"),
        ("negative advantage clip", ["advantage.clip=-5"], "advantage.clip"),
        ("negative KL weight", ["grpo.kl_coef=-0.1"], "grpo.kl_coef"),
        ("zero LoRA alpha", ["lora.alpha=0"], "lora.alpha"),
        ("LoRA dropout of 1", ["lora.dropout=1"], "lora.dropout"),
        ("negative guidance", ["sampling.guidance=-1"], "sampling.guidance"),
        ("timestep fraction above 1", ["grpo.timestep_fraction=1.5"], "grpo.timestep_fraction"),
        ("negative profiled rank", ["profile.ranks=[-1]"], "profile.ranks"),
        ("keep no checkpoint", ["checkpoint.keep=0"], "checkpoint.keep"),
        ("EMA decay out of range", ["ema.decay=1.5"], "ema.decay"),
        ("zero comm timeout", ["faults.comm_timeout_s=0"], "faults.comm_timeout_s"),
        ("zero skip limit", ["faults.max_consecutive_skips=0"], "faults.max_consecutive_skips"),
        ("wandb not installed", ["logging.wandb=true"], "logging.wandb"),
        ("unknown dtype", ["model.dtype=fp64"], "model.dtype"),
        ("unknown text encoder placement", ["data.text_encoder_device_map=everywhere"], "data.text_encoder_device_map"),
        ("text encoder cap not a size", ["data.text_encoder_device_map=auto", "data.text_encoder_max_memory.device=30"],
         "data.text_encoder_max_memory.device"),
        ("empty LoRA targets", ["lora.target_modules=[]"], "lora.target_modules"),
        ("LoRA target matching no module", ["lora.target_modules=[to_q, no_such_module]"], "lora.target_modules"),
        ("resume from a folder that is not a checkpoint", [f"checkpoint.resume={not_ckpt}"], "checkpoint.resume"),
        ("resume from a checkpoint missing a file", [f"checkpoint.resume={missing_file}"], "checkpoint.resume"),
        ("resume=auto with every checkpoint damaged", ["checkpoint.resume=auto", f"output_dir={damaged_run}"],
         "checkpoint.resume"),
        ("output_dir inside a file", [f"output_dir={a_file / 'run'}"], "output_dir"),
        ("output_dir is a file", [f"output_dir={a_file}"], "output_dir"),
        ("output_dir not writable", [f"output_dir={unwritable}"], "output_dir"),
        ("output_dir in use by a live job", [f"output_dir={locked}"], "output_dir"),
    ]
    out = []
    for i, (name, argv, setting) in enumerate(cases):
        given = [a.split("=", 1)[1] for a in argv if a.startswith("output_dir=")]
        run_dir = Path(given[0]) if given else tmp / f"out{i}"
        argv = [a for a in argv if not a.startswith("output_dir=")]
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


def start_up_error(argv: list[str]) -> str | None:
    """The recipe's start-up checks for `--config CONFIG OVERRIDES` on 1 process, as it runs them before setup():
    the `error: ...` line of the first that fails (what the recipe prints before exiting 2), None when all pass."""
    assert argv[0] == "--config"
    try:
        cfg = load_config(argv[1], argv[2:])
        check_inputs(cfg, 1)
        resume_point(cfg, 1)
    except ConfigError as e:
        return f"error: {e}"
    return None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    cases = _cases(tmp)
    before = {c["name"]: snapshot(Path(c["out"])) for c in cases}
    got = {c["name"]: start_up_error(c["argv"]) for c in cases}
    return [(c, got[c["name"]], before[c["name"]], snapshot(Path(c["out"]))) for c in cases]


def test_at_least_forty_cases(results):
    assert len(results) >= 40


def test_each_bad_input_fails_with_one_line_naming_the_setting(results):
    failures = []
    for case, line, _, _ in results:
        ok = (line is not None and len(line.splitlines()) == 1 and line.startswith(f"error: {case['setting']}")
              and len(line) < 400)
        if not ok:
            failures.append(f"{case['name']}: {line!r}")
    assert not failures, "\n".join(failures)


def test_output_dir_is_left_untouched(results):
    changed = [case["name"] for case, _, before, after in results if before != after]
    assert not changed


def test_messages_say_how_to_fix_it(results):
    """Spot checks that the line carries the fix, not just the complaint."""
    by_name = {case["name"]: line for case, line, _, _ in results}
    assert "checkpoint.resume=auto" in by_name["non-empty output_dir without resume"]
    assert "relaunch on 4 processes" in by_name["resume from another world size, optimizer on NVMe"]
    assert "sampling.group_size=8 in the checkpoint, 4 now" in by_name["resume from another preset"]
    assert "hf download" in by_name["missing reward model file"]
    assert "valid keys under sampling" in by_name["unknown nested key"]
    assert "not valid YAML (line " in by_name["malformed YAML"]
    assert "pid 1 " in by_name["output_dir in use by a live job"]
    assert "checkpoint.resume=null and choose a new output_dir" in by_name["resume=auto with every checkpoint damaged"]
    assert "is a file" in by_name["output_dir inside a file"]
    assert "no_prompt.jsonl line 2 has no \"prompt\"" in by_name["dataset row without a prompt"]
    assert "bad_image.jsonl line 1: image broken.png cannot be read" in by_name["dataset row with an unreadable image"]
    assert "tiny_train.txt line 1 has no 'color'" in by_name["metadata reward on a text file"]
