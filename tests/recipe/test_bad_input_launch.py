"""Bad input, real processes: the launchers (launch/run.sh, launch/multinode.sh) exit 2 with one line before any rank
starts, and so does a plain recipe process; output_dir is left as it was. A bad input only the ranks can find still
gives the launcher's exit 2 and one line; SIGTERM to the launcher stops the run cleanly (checkpoint, exit 0); a second
job on a live output_dir exits 2. The full table of bad inputs runs in process in tests/unit/test_bad_input.py.
"""

from __future__ import annotations

import json
import signal

import pytest

from grpo import checkpoint as ckpt
from grpo.config import load_config, to_dict
from grpo.lock import LOCK
from tests import ROOT, TINY, snapshot
from tests.recipe.launch import Run, max_abs_diff, one_error_line, run_plain, run_script, script_env, steps_logged, \
    tiny_run, train_rows, trained_weights, wait_for_step
from tools.launch import free_port

LORA = str(ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml")


def test_real_process_exits_2(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = run_plain(LORA, [f"output_dir={out}", f"model.path={TINY}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: output_dir:")
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("case", ["unknown key", "batch arithmetic of NPROC=3", "hostfile of 3 slots",
                                  "missing model folder", "missing deepspeed config"])
def test_launch_scripts_exit_2_before_torchrun(tmp_path, case):
    """The launchers run the recipe's start-up checks (tools.check) before starting any rank, so that a bad setting
    costs no rank's imports. 16 prompts x 4 images do not split over 3 processes."""
    out = tmp_path / "run"
    if case != "unknown key":
        out.mkdir()  # an existing empty output_dir stays empty
    env, args, setting = {}, [f"output_dir={out}", f"model.path={TINY}"], "batch.prompts_per_step"
    script = "run.sh"
    if case == "unknown key":
        cmd, setting = [LORA, "sampling.colour=red", *args], "sampling.colour"
    elif case == "batch arithmetic of NPROC=3":
        cmd, env["NPROC"] = [LORA, *args], "3"
    elif case == "missing model folder":
        cmd, setting = [LORA, *args, f"model.path={tmp_path / 'no_model'}"], "model.path"
    elif case == "missing deepspeed config":
        cmd, setting = [LORA, *args, f"deepspeed.config={tmp_path / 'no.json'}"], "deepspeed.config"
    else:
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("# one node\nlocalhost slots=3\n")
        script, cmd = "multinode.sh", [str(hostfile), LORA, *args]
    before = snapshot(out)
    proc = run_script(script, cmd, extra_env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert one_error_line(proc.stderr).startswith(f"error: {setting}:")
    assert "[launch]" not in proc.stderr  # no rank was started
    assert snapshot(out) == before


def test_lora_target_matching_no_module_exits_2_and_writes_nothing(tmp_path):
    """Caught on the transformer built from its config on the meta device (PEFT itself ignores an entry that matches
    nothing while others match), before anything is written: an existing empty output_dir stays empty."""
    out = tmp_path / "run"
    out.mkdir()
    proc = run_plain(LORA, ["lora.target_modules=[to_q, no_such_module]", "max_steps=1", f"output_dir={out}",
                            f"model.path={TINY}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_error_line(proc.stderr)
    assert line.startswith("error: lora.target_modules: 'no_such_module' matches no module")
    assert list(out.iterdir()) == []


def test_bad_input_found_by_the_ranks_gives_the_launcher_exit_2_and_one_line(tmp_path):
    """A resume checkpoint whose file has the right size but other bytes passes the start-up checks (structure only)
    and fails the ranks' hash check: the launcher exits 2 (not torchrun's 1), rank 0's line is the only error line and
    the last, and no traceback."""
    out = tmp_path / "run"
    args = [f"output_dir={out}", f"model.path={TINY}", f"data.cache_dir={tmp_path / 'cache'}", "max_steps=1"]
    bad = tmp_path / "old" / "checkpoints" / ckpt.checkpoint_name(3)
    bad.mkdir(parents=True)
    (bad / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"y" * 64)
    meta = {"format": ckpt.FORMAT, "step": 3, "world_size": 2, "lora": True, "ema": False,
            "config": to_dict(load_config(LORA, args)), "files": {"zero_pp_rank_0_mp_rank_00_model_states.pt":
                                                                  [64, "0" * 64]}}
    (bad / "meta.json").write_text(json.dumps(meta))
    proc = run_script("run.sh", [LORA, *args, f"checkpoint.resume={bad}"], extra_env={"NPROC": "2",
                                                                                     "MASTER_PORT": str(free_port())})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "[launch]" in proc.stderr  # the ranks ran
    assert one_error_line(proc.stderr).startswith(f"error: checkpoint.resume: {bad} is not a usable checkpoint")
    assert "ChildFailedError" not in proc.stderr
    assert not (out / LOCK).exists()


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A 2-process run through launch/run.sh; after its first step a second job on the same output_dir is started,
    then the launcher gets SIGTERM (what a scheduler sends on preemption) while the next step runs."""
    tmp = tmp_path_factory.mktemp("sigterm")
    out = tmp / "run"
    args = [*tiny_run(tmp), "max_steps=50", "checkpoint.every=100", "data.eval_prompts=null", "logging.sample_every=0",
            "logging.tensorboard=false", f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}"]
    env = {k: v for k, v in script_env({"NPROC": "2", "MASTER_PORT": str(free_port())}).items()}
    run = Run.start(["bash", str(ROOT / "launch" / "run.sh"), LORA, *args], tmp / "run.log", env)
    try:
        wait_for_step(run, 0, timeout=400)
        second = run_script("run.sh", [LORA, *args, "checkpoint.resume=auto"], extra_env={"NPROC": "2"}, timeout=300)
        holder = json.loads((out / LOCK).read_text())
        run.proc.send_signal(signal.SIGTERM)
        rc = run.wait(400)
    finally:
        if run.proc.poll() is None:
            run.kill_all()
    return {"rc": rc, "out": out, "log": run.log.read_text(errors="replace"), "second": second, "holder": holder,
            "steps": steps_logged(run), "args": args}


def test_a_second_job_on_a_live_output_dir_exits_2_naming_the_holder(stopped_run):
    second, holder = stopped_run["second"], stopped_run["holder"]
    assert second.returncode == 2, second.stderr[-2000:]
    line = one_error_line(second.stderr)
    assert line.startswith(f"error: output_dir: {stopped_run['out']} is in use by host {holder['host']} "
                           f"pid {holder['pid']} ")
    assert "[launch]" not in second.stderr  # refused before torchrun


def test_sigterm_to_the_launcher_saves_a_checkpoint_and_exits_0(stopped_run):
    assert stopped_run["rc"] == 0, stopped_run["log"][-3000:]
    assert "[launch] SIGTERM: passed to 2 workers" in stopped_run["log"]
    assert "Traceback" not in stopped_run["log"] and "SignalException" not in stopped_run["log"]
    saved = ckpt.list_checkpoints(stopped_run["out"] / "checkpoints")
    done = len(train_rows(stopped_run["out"]))
    assert [p.name for p in saved] == [ckpt.checkpoint_name(done)] and 1 <= done < 50
    assert ckpt.verify(saved[0]) is None
    assert not (stopped_run["out"] / LOCK).exists()  # released on exit


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_to_the_uninterrupted_weights(stopped_run, tmp_path):
    """Preemption end to end: the SIGTERM'd run, resumed with checkpoint.resume=auto for one more step, ends with the
    very weights of a run that was never interrupted."""
    out, done = stopped_run["out"], len(train_rows(stopped_run["out"]))
    common = [a for a in stopped_run["args"] if not a.startswith(("max_steps=", "output_dir="))]
    common.append(f"max_steps={done + 1}")
    resumed = run_script("run.sh", [LORA, *common, f"output_dir={out}", "checkpoint.resume=auto"],
                         extra_env={"NPROC": "2"}, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    fresh = run_script("run.sh", [LORA, *common, f"output_dir={tmp_path / 'fresh'}"], extra_env={"NPROC": "2"},
                       timeout=600)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    final = ckpt.checkpoint_name(done + 1)
    assert max_abs_diff(trained_weights(out / "checkpoints" / final, "model"),
                        trained_weights(tmp_path / "fresh" / "checkpoints" / final, "model")) == 0.0
