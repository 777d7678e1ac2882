"""Failures outside the run end it cleanly (issue 34): one `error:` line on rank 0 naming the thing and the fix, no
traceback on stderr (it goes to output_dir/logs/error_rank0.txt), an exit code that says what to do, and the last
complete checkpoint usable. A refused start leaves output_dir as it was, to its mtime.

- A reward server (`python -m tools.rewards serve`, a real process) killed in a 3-step run without periodic
  checkpoints, once inside step 1 and once before the eval of step 2: exit 75 (retry later) each time, with a
  checkpoint of the completed steps saved on the way out; a server started again and checkpoint.resume=auto continue
  to the uninterrupted run's rows (the held-out evals included, the failed one done again) and LoRA.
- A full disk (a 3 MiB tmpfs, a checkpoint every step, keep 1): step 2's checkpoint does not fit; exit 1 with one
  line naming the folder, step 1's checkpoint kept, verified, and the only one resume can pick.
- A VLM judge that keeps answering out of format: exit 1, one line naming the answer and the fixes.
- A refused resume (every checkpoint of output_dir damaged, found only by the ranks' hashes) leaves output_dir
  byte-identical, its own mtime included: the checks run before output_dir/.lock is taken.
- A rank lost mid-run (kill -9 of rank 1, and of rank 0): exit 75 with the launcher's line naming it, and
  checkpoint.resume=auto continues to the uninterrupted run's rows and LoRA.
- output_dir remounted read-only mid-run (a 64 MiB tmpfs; before a checkpoint, before a metrics row): exit 1, one line
  naming the path and EROFS, everything written before kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from grpo import checkpoint as ckpt
from grpo.errors import EXIT_RETRY_LATER
from tests import ROOT, snapshot
from tests.recipe.launch import (Run, metrics_rows, one_error_line, run_script, script_env, tiny_run, train_rows,
                                 wait_for_step)
from tests.recipe.test_remote_reward import _wait_healthy
from tests.recipe.test_rewards_vlm_judge import judge_url  # noqa: F401 -- the judge server, a fixture
from tools.launch import free_port, launch_env

LORA = str(ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml")
COMPARED = ("reward_mean", "reward_std", "loss", "grad_norm", "lr", "clip_frac")


class Server:
    """`python -m tools.rewards serve` on a fixed localhost port: started, killed, started again."""

    def __init__(self, tmp, port: int):
        self.config, self.port, self.log = tmp / "served.yaml", port, tmp / "server.log"
        self.config.write_text(json.dumps({"rewards": {"jpeg_compressibility": 1.0}}))
        self.url, self.proc = f"http://127.0.0.1:{port}", None

    def start(self) -> None:
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tools.rewards", "serve", str(self.config), "--port",
                                          str(self.port), "--device", "cpu"], cwd=ROOT, env=launch_env(),
                                         stdout=out, stderr=subprocess.STDOUT)
        _wait_healthy(self.proc, self.url, self.log)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


@pytest.mark.slow
def test_a_reward_server_that_stops_answering_ends_with_75_and_resumes_exactly(tmp_path):
    server = Server(tmp_path, free_port())
    remote = {"remote": {"url": server.url, "reward": "jpeg_compressibility", "retries": 1, "backoff": 0.2,
                         "timeout": 20}}
    # No periodic checkpoint (every 100 steps): the checkpoints the resumes need are the ones saved when the server
    # is found gone. Evals (scored by the same server) at steps 0, 2 and 3: killed after step 0, the server is missed
    # by step 1's scoring (inside a step); killed after step 1, by the eval of step 2 (between steps).
    common = [*tiny_run(tmp_path), "max_steps=3", "checkpoint.every=100", "logging.eval_every=2",
              "logging.eval_seeds=1", "logging.sample_every=0", "logging.tensorboard=false",
              f"data.cache_dir={tmp_path / 'cache'}", "rewards=" + json.dumps(remote)]

    def launch(out, log, *extra):
        return Run.start(["bash", str(ROOT / "launch" / "run.sh"), LORA, *common, f"output_dir={out}", *extra],
                         tmp_path / log, script_env({"NPROC": "2", "MASTER_PORT": str(free_port())}))

    def cut_after(step: int, log: str, *extra) -> None:
        interrupted = launch(cut, log, *extra)
        wait_for_step(interrupted, step)
        server.kill()
        rc = interrupted.wait(300)
        text = interrupted.log.read_text(errors="replace")
        assert rc == EXIT_RETRY_LATER, text[-3000:]
        line = one_error_line(text)
        assert line.startswith(f"error: rewards.remote: {server.url}/score/jpeg_compressibility failed after 2 "
                               "attempts: ConnectionError; the server stopped answering"), line
        assert "checkpoint.resume=auto" in line
        traceback_file = cut / "logs" / "error_rank0.txt"
        assert f"(traceback: {traceback_file})" in line and "Traceback" in traceback_file.read_text()
        assert [r["step"] for r in train_rows(cut)] == list(range(step + 1))
        saved = ckpt.list_checkpoints(cut / "checkpoints")
        assert saved[0].name == ckpt.checkpoint_name(step + 1) and ckpt.verify(saved[0]) is None
        server.start()

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    try:
        server.start()
        done = launch(whole, "whole.log")
        assert done.wait(600) == 0, done.tail()
        cut_after(0, "cut0.log")
        cut_after(1, "cut1.log", "checkpoint.resume=auto")
        resumed = launch(cut, "resumed.log", "checkpoint.resume=auto")
        assert resumed.wait(600) == 0, resumed.tail()
    finally:
        server.kill()
    a, b = train_rows(whole), train_rows(cut)
    assert [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in COMPARED} == {k: rb.get(k) for k in COMPARED}, ra["step"]
    evals = [[(r["step"], r["eval/reward_mean"]) for r in metrics_rows(d) if "eval/reward_mean" in r]
             for d in (whole, cut)]
    assert evals[1] == evals[0] and [s for s, _ in evals[0]] == [0, 2, 3]  # each once, the failed one done again
    la, lb = (load_file(str(next((d / "final" / "lora").glob("*.safetensors")))) for d in (whole, cut))
    assert la.keys() == lb.keys() and all((la[k] == lb[k]).all() for k in la)


@pytest.mark.slow
def test_a_judge_that_answers_out_of_format_ends_with_one_line(tmp_path, judge_url):
    """A VLM judge (tests/recipe/judge_server.py) whose template makes it ramble instead of answering "Score: S":
    exit 1, one line with the answer, the expected format and the fixes, the traceback in output_dir/logs/."""
    judge = {"vlm_judge": {"url": judge_url, "model": "tiny-judge", "retries": 0,
                           "template": "Rate how well this shows {prompt}, and ramble."}}
    out = tmp_path / "run"
    args = [*tiny_run(tmp_path), "max_steps=2", "data.eval_prompts=null", "logging.sample_every=0",
            "logging.tensorboard=false", f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}",
            "rewards=" + json.dumps(judge)]
    proc = run_script("run.sh", [LORA, *args], extra_env={"NPROC": "2", "MASTER_PORT": str(free_port())}, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert line.startswith("error: rewards.vlm_judge: the judge answered 'What a lovely picture, I would give it a "
                           "high mark.', expected a whole answer matching"), line
    assert "rewards.vlm_judge.on_malformed: nan" in line and f"(traceback: {out / 'logs' / 'error_rank0.txt'})" in line
    assert train_rows(out) == []


def _stat(path):
    st = path.stat()
    return st.st_mtime_ns, st.st_size


@pytest.mark.slow
def test_a_refused_resume_leaves_output_dir_as_it_was(tmp_path):
    """output_dir's only checkpoint has a file of the right size but other bytes: the start-up checks (structure)
    pass, the ranks' hashes refuse it (`auto` finds only damaged ones), exit 2, before the lock: nothing written,
    nothing moved aside, no mtime changed."""
    from grpo.config import load_config, to_dict

    out = tmp_path / "run"
    args = [*tiny_run(tmp_path), f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "max_steps=1"]
    bad = out / "checkpoints" / ckpt.checkpoint_name(3)
    bad.mkdir(parents=True)
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    (bad / name).write_bytes(b"y" * 64)
    meta = {"format": ckpt.FORMAT, "step": 3, "world_size": 2, "lora": True, "ema": False,
            "config": to_dict(load_config(LORA, args)), "files": {name: [64, "0" * 64]}}
    (bad / "meta.json").write_text(json.dumps(meta))
    os.utime(out, ns=(10**18, 10**18))  # a distinct mtime: any entry made and removed in output_dir changes it
    before = (snapshot(out), _stat(out), _stat(out / "checkpoints"))
    proc = run_script("run.sh", [LORA, *args, "checkpoint.resume=auto"],
                      extra_env={"NPROC": "2", "MASTER_PORT": str(free_port())}, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "[launch]" in proc.stderr  # the ranks ran: the hash check is theirs
    assert one_error_line(proc.stderr).startswith("error: checkpoint.resume: auto finds no valid checkpoint")
    assert (snapshot(out), _stat(out), _stat(out / "checkpoints")) == before


def _tmpfs(tmp_path, size: str):
    """A tmpfs of `size` mounted at tmp_path/disk for the test's length; root only (else the test is skipped)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 2.8 MiB tmpfs (room for one tiny LoRA checkpoint of 1.47 MiB and the run's other files, not two: at 3 MiB two
    fitted once the run's other files had shrunk)."""
    yield from _tmpfs(tmp_path, "2800k")


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_ends_with_one_line_and_keeps_the_previous_one(tmp_path, small_disk,
                                                                                       uninterrupted):
    out = small_disk / "run"
    command = ["bash", str(ROOT / "launch" / "run.sh"), LORA, *tiny_run(tmp_path), "max_steps=3",
               "checkpoint.every=1", "checkpoint.keep=1", "data.eval_prompts=null", "logging.sample_every=0",
               "logging.tensorboard=false", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}"]
    run = Run.start(command, tmp_path / "run.log", script_env({"NPROC": "2", "MASTER_PORT": str(free_port())}))
    rc = run.wait(600)
    log = run.log.read_text(errors="replace")
    assert rc == 1, log[-3000:]
    root = out / "checkpoints"
    line = one_error_line(log)
    # Caught before writing: step 2's checkpoint needs step 1's 1.5 MiB, which the 2.8 MiB disk no longer has.
    assert line.startswith(f"error: checkpoint: no space left on the device of {root} for "
                           f"{ckpt.checkpoint_name(2)} (needs about 1.5 MiB"), line
    assert f"the previous checkpoint {root / ckpt.checkpoint_name(1)} is intact" in line
    assert "checkpoint.resume=auto" in line
    # The half-written one is never a candidate; the previous one was not pruned and passes every hash.
    assert [p.name for p in ckpt.list_checkpoints(root)] == [ckpt.checkpoint_name(1)]
    assert not list(root.glob(".tmp-*"))
    assert (root / ckpt.LATEST).read_text() == ckpt.checkpoint_name(1)
    assert ckpt.newest_valid(root) == root / ckpt.checkpoint_name(1)
    # Space freed (the disk grown), checkpoint.resume=auto ends where the uninterrupted run does
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = Run.start([*command, "checkpoint.resume=auto"], tmp_path / "resumed.log",
                        script_env({"NPROC": "2", "MASTER_PORT": str(free_port())}))
    assert resumed.wait(600) == 0, resumed.tail()
    whole = uninterrupted[1]
    a, b = train_rows(whole), train_rows(out)
    assert [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in COMPARED} == {k: rb.get(k) for k in COMPARED}, ra["step"]
    la, lb = (load_file(str(next((d / "final" / "lora").glob("*.safetensors")))) for d in (whole, out))
    assert la.keys() == lb.keys() and all((la[k] == lb[k]).all() for k in la)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 3-step 2-process run that the lost-rank runs are compared with: (its settings, its output_dir)."""
    tmp = tmp_path_factory.mktemp("whole")
    common = [*tiny_run(tmp), "max_steps=3", "checkpoint.every=1", "data.eval_prompts=null",
              "logging.sample_every=0", "logging.tensorboard=false", f"data.cache_dir={tmp / 'cache'}"]
    whole = tmp / "whole"
    done = _launch(common, whole, tmp / "whole.log")
    assert done.wait(600) == 0, done.tail()
    return common, whole


def _launch(common, out, log, *extra):
    return Run.start(["bash", str(ROOT / "launch" / "run.sh"), LORA, *common, f"output_dir={out}", *extra], log,
                     script_env({"NPROC": "2", "MASTER_PORT": str(free_port())}))


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0])
def test_a_rank_killed_mid_run_ends_with_75_naming_it_and_resumes_exactly(tmp_path, uninterrupted, lost):
    """kill -9 of one rank after step 1 (its peer is then in a collective or about to enter one; step 2's checkpoint
    may be in flight): launch/run.sh exits 75 with one line naming that rank, its pid and the signal, no traceback on
    the terminal; checkpoint.resume=auto continues to the uninterrupted run's rows and LoRA. Rank 0 lost: the rank
    that writes metrics.jsonl and holds output_dir's lock (left behind, taken over by the resumed run)."""
    import signal

    common, whole = uninterrupted
    cut = tmp_path / "cut"
    run = _launch(common, cut, tmp_path / "cut.log")
    wait_for_step(run, 1)
    victim = next(p for p in run.workers() if p.environ().get("RANK") == str(lost))
    victim.send_signal(signal.SIGKILL)
    rc = run.wait(300)
    log = run.log.read_text(errors="replace")
    assert rc == EXIT_RETRY_LATER, log[-3000:]
    line = one_error_line(log)
    assert line.startswith(f"error: rank {lost} (pid {victim.pid} on "), line
    assert "was killed by signal 9 (SIGKILL)" in line and "checkpoint.resume=auto" in line
    # the survivor's side: its traceback kept under output_dir/logs, not shown
    assert "Traceback" in (cut / "logs" / f"error_rank{1 - lost}.txt").read_text()
    newest = ckpt.newest_valid(cut / "checkpoints")
    assert newest is not None and ckpt.checkpoint_step(newest) in (1, 2)
    resumed = _launch(common, cut, tmp_path / "resumed.log", "checkpoint.resume=auto")
    assert resumed.wait(600) == 0, resumed.tail()
    a, b = train_rows(whole), train_rows(cut)
    assert [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in COMPARED} == {k: rb.get(k) for k in COMPARED}, ra["step"]
    la, lb = (load_file(str(next((d / "final" / "lora").glob("*.safetensors")))) for d in (whole, cut))
    assert la.keys() == lb.keys() and all((la[k] == lb[k]).all() for k in la)


@pytest.fixture
def remountable_disk(tmp_path):
    """A 64 MiB tmpfs that the test remounts read-only mid-run (as root, chmod would not stop the writes)."""
    yield from _tmpfs(tmp_path, "64m")


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["checkpoint", "metrics"])
def test_an_output_dir_turned_read_only_mid_run_ends_with_one_line_and_loses_nothing(tmp_path, remountable_disk,
                                                                                      moment):
    """output_dir's file system remounted read-only after step 1 is logged, so step 2's checkpoint is the first write
    refused (DeepSpeed's torch.save, which names no errno); or after step 2's checkpoint, so step 2's metrics row is
    (rank 0 alone; the ranks agree). Exit 1, one line naming the path and "Read-only file system", no traceback on
    the terminal (it went to the temporary directory, output_dir being unwritable); every row and checkpoint written
    before is there and verifies once the disk is writable again."""
    import re

    out = remountable_disk / "run"
    run = Run.start(["bash", str(ROOT / "launch" / "run.sh"), LORA, *tiny_run(tmp_path), "max_steps=4",
                     "checkpoint.every=1", "data.eval_prompts=null",
                     # grids only where they cannot race the remount: step 1's is written before the checkpoint
                     f"logging.sample_every={int(moment == 'metrics')}",
                     "logging.tensorboard=true", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}"],
                    tmp_path / "run.log", script_env({"NPROC": "2", "MASTER_PORT": str(free_port())}))
    if moment == "checkpoint":
        wait_for_step(run, 1)
    else:
        deadline = time.monotonic() + 400
        while f"checkpoint {out / 'checkpoints' / ckpt.checkpoint_name(2)}" not in run.log.read_text(errors="replace"):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.tail()
            time.sleep(0.05)
    subprocess.run(["mount", "-o", "remount,ro", str(remountable_disk)], check=True)
    rc = run.wait(300)
    log = run.log.read_text(errors="replace")
    assert rc == 1, log[-3000:]
    line = one_error_line(log)
    assert line.startswith(f"error: output_dir: cannot write {out}"), line
    assert "Read-only file system (EROFS)" in line and "checkpoint.resume=auto" in line
    kept = re.search(r"\(traceback: (\S+), output_dir being unwritable\)$", line)
    assert kept and "Traceback" in Path(kept.group(1)).read_text(), line
    subprocess.run(["mount", "-o", "remount,rw", str(remountable_disk)], check=True)
    steps = [r["step"] for r in train_rows(out)]
    newest = ckpt.newest_valid(out / "checkpoints")
    assert steps == [0, 1]
    # the refused checkpoint (step 2's: written from the remount on, unless the remount came after it) left the
    # previous one in place
    refused_checkpoint = f"(checkpoint {ckpt.checkpoint_name(2)})" in line
    assert newest is not None and ckpt.checkpoint_step(newest) == (1 if refused_checkpoint else 2), (line, newest)
    if moment == "metrics":
        assert line.startswith(f"error: output_dir: cannot write {out / 'metrics.jsonl'} (metrics and samples of "
                               "step 2)"), line
        assert (out / "samples" / "step_00001.png").is_file()
