"""Checkpoints you can trust: a dead node, SIGTERM, a corrupted checkpoint and kill -9, each followed by resume=auto.

One chain of short runs of the same preset (LoRA, EMA on, a checkpoint every step, world size 2, CPU):

    reference  uninterrupted, 1 node x 2 processes
    B          2 "nodes" x 1 process (launch/multinode.sh --torchrun twice, meeting on 127.0.0.1); node 1 is frozen
               (SIGSTOP: a node that vanished without closing its sockets) at a random point, so node 0 must give up
               on its own within faults.comm_timeout_s and exit non-zero; node 1 is then SIGKILLed
    C          resume=auto on 1 node x 2 processes; SIGTERM to the workers at a random point: it saves and exits 0
               -> then the newest checkpoint is truncated
    D          resume=auto: must warn and start from the previous checkpoint; the whole run is SIGKILLed at a
               random point (possibly while a checkpoint is being written)
    E          resume=auto to the end

E's final weights and EMA (fp32) must equal the reference's, and its metrics must read like the reference's.
Kill points are random; the seed is in every failure message (GRPO_TEST_SEED=... reproduces a chain).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from grpo import checkpoint as ckpt
from tests import ROOT
from tests.recipe.launch import Run, kill_leftovers, max_abs_diff, tiny_run, torchrun, train_rows, trained_weights, \
    wait_for_step
from tools.launch import free_port

pytestmark = pytest.mark.slow

CONFIG = "recipes/configs/tiny/grpo_lora.yaml"
MAX_STEPS = 6
TIMEOUT_S = 20  # faults.comm_timeout_s of the chain


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chain")
    seed = int(os.environ.get("GRPO_TEST_SEED", time.time_ns() % 100000))
    rng = random.Random(seed)
    heldout = tmp / "heldout.txt"
    heldout.write_text("a red circle on a cyan background\na blue square on a yellow background\n")
    common = [*tiny_run(tmp), f"max_steps={MAX_STEPS}", "checkpoint.every=1", "checkpoint.keep=3",
              "ema.decay=0.9", "logging.eval_every=3", "logging.sample_every=2", f"data.eval_prompts={heldout}",
              f"data.cache_dir={tmp / 'cache'}", f"faults.comm_timeout_s={TIMEOUT_S}"]
    ref_out, out = tmp / "reference", tmp / "run"
    runs: list[Run] = []
    info: dict = {"seed": seed, "ref": ref_out, "out": out}
    try:
        ref = Run.start(torchrun(CONFIG, [*common, f"output_dir={ref_out}"]), tmp / "reference.log")
        runs.append(ref)
        info["ref_rc"] = ref.wait(900)

        # B: two single-process "nodes"; freeze node 1 at a random point.
        port = free_port()
        nodes = [Run.start(["bash", str(ROOT / "launch" / "multinode.sh"), "--torchrun", str(ROOT / CONFIG),
                            *common, f"output_dir={out}"], tmp / f"node{i}.log",
                           {"NNODES": "2", "NODE_RANK": str(i), "NPROC": "1", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)})
                 for i in range(2)]
        runs += nodes
        k = rng.randint(1, 2)
        wait_for_step(nodes[0], k)
        time.sleep(rng.uniform(0, 1.5))
        nodes[1].signal_workers(signal.SIGSTOP)
        frozen_at = time.monotonic()
        info["node0_rc"] = nodes[0].wait(TIMEOUT_S + 120)
        info["node0_exit_s"] = time.monotonic() - frozen_at
        info["node0_log"] = nodes[0].log.read_text(errors="replace")
        nodes[1].kill_all()
        info["after_B"] = [p.name for p in ckpt.list_checkpoints(out / "checkpoints")]

        # C: resume on one node, SIGTERM to the workers at a random point.
        c = Run.start(torchrun(CONFIG, [*common, f"output_dir={out}", "checkpoint.resume=auto"]), tmp / "C.log")
        runs.append(c)
        done_before = ckpt.checkpoint_step(ckpt.list_checkpoints(out / "checkpoints")[0])
        wait_for_step(c, done_before)  # at least one step of its own
        time.sleep(rng.uniform(0, 1.5))
        c.signal_workers(signal.SIGTERM)
        info["C_rc"] = c.wait(300)
        info["C_log"] = c.tail(20000)
        newest = ckpt.list_checkpoints(out / "checkpoints")[0]
        info["C_newest"] = newest.name
        info["C_newest_valid"] = ckpt.verify(newest) is None

        # Truncate the newest checkpoint: rank 1's optimizer shard loses half its bytes.
        victim = next(newest.glob("*zero_pp_rank_1_*optim_states.pt"))
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        info["corrupted"] = newest.name

        # D: resume (must skip the corrupted one), then kill -9 of the whole run at a random point.
        d = Run.start(torchrun(CONFIG, [*common, f"output_dir={out}", "checkpoint.resume=auto"]), tmp / "D.log")
        runs.append(d)
        resumed = ckpt.checkpoint_step(newest) - 1
        wait_for_step(d, resumed)
        time.sleep(rng.uniform(0, 2.5))
        d.kill_all()
        info["D_log"] = d.tail(20000)

        # E: resume to the end.
        e = Run.start(torchrun(CONFIG, [*common, f"output_dir={out}", "checkpoint.resume=auto"]), tmp / "E.log")
        runs.append(e)
        info["E_rc"] = e.wait(900)
        info["E_log"] = e.tail(20000)
        info["logs"] = {r.log.name: r.tail() for r in runs}
        yield info
    finally:
        kill_leftovers(runs)


def _why(chain) -> str:
    return f"seed {chain['seed']}; logs:\n" + "\n".join(f"--- {k}\n{v}" for k, v in chain.get("logs", {}).items())


def test_reference_run_and_its_observability(chain):
    ref = chain["ref"]
    assert chain["ref_rc"] == 0, _why(chain)
    rows = train_rows(ref)
    assert [r["step"] for r in rows] == list(range(MAX_STEPS))
    assert all(r["skipped_updates"] == 0 and r["nonfinite/loss"] == 0 for r in rows)
    evals = [r["step"] for r in map(json.loads, (ref / "metrics.jsonl").read_text().splitlines())
             if "eval/reward_mean" in r]
    assert evals == [0, 3, 6]
    assert (ref / "reward_curve.png").stat().st_size > 1000
    assert (ref / "samples" / "step_00004.png").is_file() and (ref / "samples" / "eval_step_00006.png").is_file()
    assert list((ref / "tensorboard").iterdir())
    # keep=3: only the newest three checkpoints remain, each verifiable; `latest` names the newest
    names = [p.name for p in ckpt.list_checkpoints(ref / "checkpoints")]
    assert names == [ckpt.checkpoint_name(s) for s in (6, 5, 4)]
    assert (ref / "checkpoints" / "latest").read_text() == names[0]
    assert all(ckpt.verify(ref / "checkpoints" / n) is None for n in names)
    health = [line for line in chain["logs"]["reference.log"].splitlines() if "ratio_max_dev" in line]
    assert health and "grad_norm" in health[-1] and "nonfinite reward/loss/grad 0/0/0" in health[-1]


def test_frozen_node_makes_the_other_fail_within_the_comm_timeout(chain):
    assert chain["node0_rc"] not in (0, None), _why(chain)
    assert chain["node0_exit_s"] < TIMEOUT_S + 60, (chain["node0_exit_s"], _why(chain))
    assert chain["after_B"], "the two-node run wrote no checkpoint before node 1 froze"
    assert f"another rank died or stopped responding (faults.comm_timeout_s={TIMEOUT_S})" in chain["node0_log"]


def test_sigterm_saves_and_exits_0(chain):
    assert chain["C_rc"] == 0, _why(chain)
    assert "received SIGTERM" in chain["C_log"] and "stopped by signal" in chain["C_log"]
    assert chain["C_newest_valid"], chain["C_newest"]


def test_corrupted_newest_checkpoint_is_skipped_with_a_warning(chain):
    assert f"checkpoint {chain['out'] / 'checkpoints' / chain['corrupted']} is incomplete or corrupted" in \
        chain["D_log"], _why(chain)
    assert "using the previous one" in chain["D_log"]
    assert f"resumed from {chain['out'] / 'checkpoints'}" in chain["D_log"]


def test_resumed_run_ends_exactly_where_the_uninterrupted_one_does(chain):
    assert chain["E_rc"] == 0, _why(chain)
    final = ckpt.checkpoint_name(MAX_STEPS)
    for which in ("model", "ema"):
        ours = trained_weights(chain["out"] / "checkpoints" / final, which)
        theirs = trained_weights(chain["ref"] / "checkpoints" / final, which)
        assert max_abs_diff(ours, theirs) <= 1e-6, (which, _why(chain))
    rows, ref_rows = train_rows(chain["out"]), train_rows(chain["ref"])
    assert [r["step"] for r in rows] == list(range(MAX_STEPS))  # lost steps were dropped, redone once
    for a, b in zip(rows, ref_rows):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-9)
