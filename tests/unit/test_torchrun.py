"""tools/torchrun.py, the launchers' torchrun, in-process: which worker's exit code it passes on, its grace period
setting, the line a rank's exit leaves for a plain torchrun's report; tools/deepspeed_run.py's workers and exit code.
With real launchers and stand-in workers (exit codes, stop signals passed on and waited for):
tests/recipe/test_torchrun.py."""

from __future__ import annotations

from types import SimpleNamespace

from tools import torchrun as tr


def test_exit_code_of_the_first_worker_with_a_meaning():
    f = lambda code, t: SimpleNamespace(exitcode=code, timestamp=t)  # noqa: E731
    assert tr.exit_code({0: f(1, 5), 1: f(2, 5)}) == (2, None)  # a peer's follow-on failure does not hide the 2
    assert tr.exit_code({0: f(-15, 5), 1: f(3, 6)}) == (3, None)
    code, line = tr.exit_code({0: f(-15, 5), 1: f(7, 6)})
    assert code == 1 and line.startswith("[launch] rank 1 exited with code 7")
    assert tr.exit_code({1: f(-9, 5)})[1].startswith("[launch] rank 1 was killed by SIGKILL")
    assert tr.exit_code({0: f(-15, 5), 1: f(75, 6)}) == (75, None)  # a dependency is down: retry later


def test_an_outside_failure_one_rank_met_alone_is_its_line():
    """grpo.errors.outside_exit leaves the line in every failing rank's error file (torchelastic's format): printed by
    the launcher when rank 0 did not print it (stopped by torchrun while waiting for its peer), else not again."""
    line = "error: checkpoint: no space left"
    said = lambda code, t, m: SimpleNamespace(exitcode=code, timestamp=t, message=m)  # noqa: E731
    assert tr.exit_code({0: said(-15, 6, "Signal 15"), 1: said(1, 5, {"message": line})}) == (1, line)
    assert tr.exit_code({0: said(1, 6, {"message": line}), 1: said(1, 5, {"message": line})}) == (1, None)


def test_bad_grace_period_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("GRACE_S", "soon")
    assert tr.main(["x.py"]) == 2
    assert capsys.readouterr().err.startswith("error: GRACE_S: 'soon';")


def test_rank_exit_names_the_line_as_a_plain_torchruns_root_cause(tmp_path, monkeypatch, capsys):
    """Rank 0 prints the line once and leaves it in torchelastic's error file, which torchrun's ChildFailedError
    report shows as the root cause; another rank prints and writes nothing."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from grpo.errors import rank_exit

    files = {rank: tmp_path / f"error{rank}.json" for rank in (0, 1)}
    for rank, path in files.items():
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        assert rank_exit("error: optim.lr: must be > 0, got 0.0; e.g. 3e-4", 2) == 2
    assert capsys.readouterr().err == "error: optim.lr: must be > 0, got 0.0; e.g. 3e-4\n"
    assert not files[1].exists()
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=2, error_file=str(files[r])) for r in files}
    root_rank, root = ChildFailedError("recipe", failures).get_first_failure()
    assert root_rank == 0
    report = ChildFailedError("recipe", failures).format_msg()
    assert "traceback : error: optim.lr: must be > 0, got 0.0; e.g. 3e-4 (exit 2: bad input;" in report
    assert report.count("optim.lr") == 1


def test_deepspeed_launchers_workers_and_exit_code():
    """tools/deepspeed_run.py (launch/multinode.sh hostfile form): only a ``python -m deepspeed.launcher.launch``
    process's children are workers (pdsh's command line carries the same words); 0, 2, 3 pass, the rest is 1."""
    from tools.deepspeed_run import exit_code, is_launch

    assert is_launch(["/usr/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30="])
    assert not is_launch(["pdsh", "-S", "-f", "1024", "-w", "a,b", "cd /x;", "python", "-u", "-m",
                          "deepspeed.launcher.launch"])
    assert not is_launch(["python", "-m", "deepspeed.launcher.runner", "--hostfile", "h"])
    assert [exit_code(c, False)[0] for c in (0, 2, 3, 1, 241, -15)] == [0, 2, 3, 1, 1, 1]
    assert exit_code(241, False)[1].startswith("[launch] the DeepSpeed launcher exited with code 241")
    assert exit_code(0, True) == (1, None)  # killed after the grace period: its own line was printed
