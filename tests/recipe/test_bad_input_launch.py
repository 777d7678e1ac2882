"""Bad input, real processes: the launchers (launch/run.sh, launch/multinode.sh) exit 2 with one line before any rank
starts, and so does a plain recipe process; output_dir is left as it was. The full table of bad inputs runs in process
in tests/unit/test_bad_input.py.
"""

from __future__ import annotations

import pytest

from tests import ROOT, TINY, snapshot
from tests.recipe.launch import run_plain, run_script

LORA = str(ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml")


def test_real_process_exits_2(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = run_plain(LORA, [f"output_dir={out}", f"model.path={TINY}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: output_dir:")
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


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
    """The launchers run the recipe's start-up checks (tools.check) before starting any rank: torchrun and the
    DeepSpeed launcher report a rank's exit code 2 as 1. 16 prompts x 4 images do not split over 3 processes."""
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
    assert _one_error_line(proc.stderr).startswith(f"error: {setting}:")
    assert "[launch]" not in proc.stderr  # no rank was started
    assert snapshot(out) == before


def test_lora_target_matching_no_module_exits_2_and_writes_nothing(tmp_path):
    """Caught once the transformer is built (PEFT itself ignores an entry that matches nothing while others match);
    output_dir is written only after that, so an existing empty one stays empty."""
    out = tmp_path / "run"
    out.mkdir()
    proc = run_plain(LORA, ["lora.target_modules=[to_q, no_such_module]", "max_steps=1", f"output_dir={out}",
                            f"model.path={TINY}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_error_line(proc.stderr)
    assert line.startswith("error: lora.target_modules: 'no_such_module' matches no module")
    assert list(out.iterdir()) == []
