"""flux-grpo bench end to end on the tiny world: a 1-step 2-process run writes a checkpoint, then the bench of the
tiny suite (assets/suites/tiny: 4 tagged prompts x 2 seeds) samples the base model and the checkpoint under the
suite's protocol, scores them and writes report.json and report.md beside the run.

The default-tier test benches on 2 processes (`nproc=2`: each samples and scores its shards), scored by tiny_world
in the processes and by a reward served by `tools.rewards serve`, and checks the protocol recorded and every paired
number against the per-image rewards of scores.json. With -m slow (each a further bench or two, 3 to 25 s each on 2
shared cores): 1 process gives the 2 processes' images and rewards exactly, a rerun resumes from the finished shards
(and never reads another setting's), several checkpoints' joint report, and a bench scored by a served reward alone
against the same reward in-process."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import ROOT
from tests.recipe.launch import run_recipe, tiny_run
from tests.recipe.test_remote_reward import _wait_healthy
from tools.launch import free_port, launch_env
from tools import bench
from tools.cli import main as cli_main

LORA = "recipes/configs/tiny/grpo_lora.yaml"


def _paired(before: list[float], after: list[float]) -> tuple[float, float, float]:
    d = [b - a for a, b in zip(before, after)]
    mean = sum(d) / len(d)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)), sum(x > 0 for x in d) / len(d)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[str]]:
    """A run folder with a 1-step checkpoint, and the overrides that name its model copy and caches."""
    tmp = tmp_path_factory.mktemp("bench")
    run_dir = tmp / "run"
    overrides = [*tiny_run(tmp), f"data.cache_dir={tmp / 'cache'}", "logging.tensorboard=false",
                 f"output_dir={run_dir}"]
    train = [*overrides, "max_steps=1", "checkpoint.every=1", "logging.eval_every=1", "logging.eval_seeds=1",
             "optim.lr=1e-2", "data.eval_prompts=assets/suites/tiny/prompts.jsonl"]
    proc = run_recipe(LORA, train, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, overrides


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> str:
    """`tools.rewards serve` of tiny_world_meta (scores the scene the prompt's metadata names, refuses rows without
    it) on a free localhost port: its URL."""
    tmp = tmp_path_factory.mktemp("served")
    (tmp / "served.yaml").write_text("rewards:\n  tiny_world_meta: 1.0\n")
    port, log = free_port(), tmp / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "tools.rewards", "serve", str(tmp / "served.yaml"),
                                   "--port", str(port), "--device", "cpu"], cwd=ROOT, env=launch_env(), stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        _wait_healthy(server, url, log)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


@contextlib.contextmanager
def _one_thread():
    """One CPU thread per process, in this one and in the ranks it launches (nproc=N keeps OMP_NUM_THREADS when set):
    the 1 vs 2 processes comparison then sets the same kernels on both sides, whatever the cores of the host."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env


def _remote(url: str) -> dict:
    return {"remote": {"url": url, "reward": "tiny_world_meta", "timeout": 60}}


@pytest.fixture(scope="module")
def sharded(trained, served) -> dict:
    """`flux-grpo bench ... nproc=2` of the trained run, scored by tiny_world in the processes and by tiny_world_meta
    served: the report's folder and the rewards spec."""
    run_dir, overrides = trained
    rewards = {"tiny_world": 1.0, **_remote(served)}
    with _one_thread():
        assert cli_main(["bench", LORA, "suite=tiny", f"checkpoint={run_dir}", "nproc=2", *overrides,
                         "rewards=" + json.dumps(rewards)]) == 0
    return {"out": run_dir / "bench" / "tiny" / "step_00000001", "rewards": rewards}


def test_bench_on_two_processes_writes_the_protocol_and_the_paired_statistics_beside_the_run(sharded):
    out = sharded["out"]
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "scores.json", "grid.png", "shards"}
    report, scores = json.loads((out / "report.json").read_text()), json.loads((out / "scores.json").read_text())

    protocol = bench.read_protocol(bench.find_suite("tiny"))
    assert report["protocol"] == {k: v for k, v in protocol.items() if k != "prompts"}
    s = report["settings"]
    assert (s["resolution"], s["steps"], s["guidance"], s["true_cfg"], s["eval_seeds"], s["seed"], s["eta"]) == \
        (64, 6, 3.5, None, 2, 0, 0.0)
    assert report["suite"]["prompts"] == 4 and report["stats"]["images"] == 8
    assert report["packages"]["torch"] and "code" in report and report["checkpoints"][0]["step"] == 1
    assert report["rewards"] == sharded["rewards"]
    # 2 shards (the rollout micro-batch is 4 images) per model, one per process
    assert sorted(len(list(d.glob("*.safetensors"))) for d in (out / "shards").iterdir()) == [2, 2]

    base, after = scores["base"]["per_image"], scores["checkpoint"]["per_image"]
    assert base != after  # the checkpoint's weights were applied
    for which in ("base", "checkpoint"):  # the total: both rewards, weight 1 each, per image
        c = scores[which]["components"]
        assert scores[which]["per_image"] == pytest.approx([a + b for a, b in zip(c["tiny_world"], c["remote"])])
        # the served reward scores the scene the metadata names, as tiny_world scores the prompt's: near 1 apart
        assert max(abs(a - b) for a, b in zip(c["tiny_world"], c["remote"])) < 1e-3
    run = report["stats"]["runs"][0]
    mean, se, higher = _paired(base, after)
    assert (run["mean"], run["se"], run["higher"]) == (mean, se, higher)
    # per tag: image j shows prompt j % 4 (red circle, red square, red triangle, green circle)
    colors = ["red", "red", "red", "green"] * 2
    for color, n in (("red", 6), ("green", 2)):
        idx = [j for j in range(8) if colors[j] == color]
        row = report["stats"]["tags"]["color"][color]
        assert row["n"] == n
        assert (row["mean"], row["se"], row["higher"]) == _paired([base[j] for j in idx], [after[j] for j in idx])
    assert {k: v["n"] for k, v in report["stats"]["tags"]["shape"].items()} == {"circle": 4, "square": 2,
                                                                                 "triangle": 2}
    for name in ("tiny_world", "remote"):
        images = scores["checkpoint"]["components"][name]
        assert report["components"][name]["checkpoints"] == [sum(images) / len(images)]
    md = (out / "report.md").read_text()
    assert "![" in md and "](grid.png)" in md  # the grid beside the page, linked relatively
    assert "### By color" in md and f"{mean:+.4f}" in md and '"resolution": 64' in md


@pytest.mark.slow
def test_one_process_gives_the_same_images_and_a_rerun_does_only_what_is_left(trained, served, sharded, tmp_path):
    """The same bench on 1 process (in this one) gives the 2 processes' per-image rewards exactly (each image's noise
    and micro-batch depend on its id only). Then the 2-process folder with one finished shard lost, as an interrupted
    run leaves it: a 2-process rerun samples that shard alone (on rank 1; rank 0 has nothing left, the others' files
    stay untouched) and writes the same report; another setting gets other shards, never the stale ones."""
    run_dir, overrides = trained
    args = ["bench", LORA, "suite=tiny", f"checkpoint={run_dir}", *overrides,
            "rewards=" + json.dumps(sharded["rewards"])]
    with _one_thread():
        assert cli_main([*args, f"out={tmp_path / 'one'}"]) == 0
    one, two = (json.loads((d / "scores.json").read_text()) for d in (tmp_path / "one", sharded["out"]))
    for which in ("base", "checkpoint"):
        assert one[which]["per_image"] == two[which]["per_image"], which
        assert one[which]["components"] == two[which]["components"], which

    out = tmp_path / "resumed"  # a copy: the other tests bench the same checkpoint into its folder
    shutil.copytree(sharded["out"], out)
    assert cli_main([*args, f"out={out}"]) == 0  # every shard there: nothing sampled
    before, grid = json.loads((out / "report.json").read_text()), (out / "grid.png").read_bytes()
    files = sorted((out / "shards").glob("*/*.safetensors"))
    lost = next(f for f in files if f.parent.name.startswith("checkpoint") and f.name == "00001.safetensors")
    lost.unlink()
    kept = {f: f.stat().st_mtime_ns for f in files if f != lost}
    assert cli_main([*args, f"out={out}", "nproc=2"]) == 0  # rank 1 has a shard to sample, rank 0 none
    assert lost.is_file() and {f: f.stat().st_mtime_ns for f in kept} == kept
    after = json.loads((out / "report.json").read_text())
    assert {k: v for k, v in after.items() if k not in ("date", "command")} == \
        {k: v for k, v in before.items() if k not in ("date", "command")}
    assert (out / "grid.png").read_bytes() == grid

    # another setting (a reward weight): new shards for both models, the stale ones neither read nor touched
    assert cli_main([*args[:-1], "rewards=" + json.dumps({"tiny_world": 2.0}), f"out={out}"]) == 0
    assert len(list((out / "shards").iterdir())) == 4 and {f: f.stat().st_mtime_ns for f in kept} == kept
    other = json.loads((out / "scores.json").read_text())
    assert other["base"]["per_image"] == pytest.approx([2 * x for x in two["base"]["components"]["tiny_world"]])


@pytest.mark.slow
def test_several_checkpoints_get_a_joint_report_with_their_spread(trained, tmp_path):
    """The same checkpoint twice (as two training seeds would be given): equal gains, no spread between them; each
    keeps its folder beside its run, the joint report goes to out=; without out= it is refused (exit 2)."""
    run_dir, overrides = trained
    assert cli_main(["bench", LORA, "suite=tiny", f"checkpoint={run_dir},{run_dir}", *overrides]) == 2
    assert cli_main(["bench", LORA, "suite=tiny", f"checkpoint={run_dir},{run_dir}", f"out={tmp_path / 'joint'}",
                     *overrides]) == 0
    report = json.loads((tmp_path / "joint" / "report.json").read_text())
    one, two = report["stats"]["runs"]
    assert one == two and report["stats"]["spread"]["std"] == 0.0 and report["stats"]["spread"]["n"] == 2
    assert [c["dir"] for c in report["checkpoints"]] == [str(run_dir / "bench" / "tiny" / "step_00000001")] * 2
    assert "Between the 2 checkpoints" in (tmp_path / "joint" / "report.md").read_text()


@pytest.mark.slow
def test_a_served_reward_scores_the_bench_as_the_local_one(trained, served, tmp_path):
    """The suite's metadata reaches a reward served by `tools.rewards serve` (tiny_world_meta scores the scene the
    metadata names, and refuses rows without it): the remote bench's per-image rewards are the local bench's, up to
    the uint8 transport."""
    run_dir, overrides = trained
    remote = _remote(served)
    assert cli_main(["bench", LORA, "suite=tiny", f"checkpoint={run_dir}", f"out={tmp_path / 'remote'}",
                     *overrides, "rewards=" + json.dumps(remote)]) == 0
    assert cli_main(["bench", LORA, "suite=tiny", f"checkpoint={run_dir}", f"out={tmp_path / 'local'}", *overrides,
                     "rewards=" + json.dumps({"tiny_world_meta": 1.0})]) == 0
    served_report, local = (json.loads((tmp_path / k / "report.json").read_text()) for k in ("remote", "local"))
    assert served_report["rewards"] == remote
    sa, sb = (json.loads((tmp_path / k / "scores.json").read_text()) for k in ("remote", "local"))
    # The images travel as uint8 (grpo/rewards/remote.py): tiny_world, not a model reward that quantizes anyway,
    # moves by the rounding (measured 4.4e-5 at most); another scene (wrong metadata) would move it by ~0.1.
    for which in ("base", "checkpoint"):
        assert max(abs(x - y) for x, y in zip(sa[which]["per_image"], sb[which]["per_image"])) < 1e-3
    assert abs(served_report["stats"]["runs"][0]["mean"] - local["stats"]["runs"][0]["mean"]) < 1e-3
