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
    assert tr.exit_code({1: f(-15, 5)})[1].startswith("[launch] rank 1 was killed by SIGTERM")
    assert tr.exit_code({0: f(-15, 5), 1: f(75, 6)}) == (75, None)  # a dependency is down: retry later


def test_the_line_of_a_rank_that_exited_before_rank_0_printed_is_the_launchers():
    """Every rank leaves its line in its error file (grpo.errors.rank_exit); rank 0 prints it. When torchrun stopped
    rank 0 first (a peer exited sooner: seen in CI under load, the line was lost) or rank 0 runs on another machine,
    the launcher prints it, once."""
    line = "error: x: bad"
    f = lambda code, t, m=None: SimpleNamespace(exitcode=code, timestamp=t, message=m)  # noqa: E731
    for code in (2, 3, 75):
        assert tr.exit_code({1: f(code, 5, {"message": line}), 0: f(-15, 6, "Signal 15")}) == (code, line)
        assert tr.exit_code({1: f(code, 5, {"message": line})}) == (code, line)  # rank 0 on another node
        assert tr.exit_code({1: f(code, 5, {"message": line}), 0: f(code, 6, {"message": line})}) == (code, None)


def test_a_rank_killed_by_a_signal_is_the_lost_rank_whatever_its_peers_did():
    """kill -9 or a segfault: 75 and one line naming the rank, its pid and the signal; the peers that its death
    reached (exit 75 with their line, grpo.errors.peer_lost_exit) or that torchrun then stopped (SIGTERM, or SIGKILL
    30 s later when stuck in a collective: recorded after the lost one) are not it."""
    f = lambda code, pid, m=None: SimpleNamespace(exitcode=code, pid=pid, timestamp=5, message=m)  # noqa: E731
    peer = f(75, 10, {"message": "error: a collective failed (...)"})
    for sig, name in ((9, "SIGKILL"), (11, "SIGSEGV")):
        code, line = tr.exit_code({1: f(-sig, 11), 0: peer})
        assert code == 75 and line.startswith(f"error: rank 1 (pid 11 on ") and "\n" not in line
        assert f"was killed by signal {sig} ({name})" in line and "checkpoint.resume=auto" in line
    assert tr.exit_code({0: f(-9, 10), 1: f(-15, 11)})[1].startswith("error: rank 0 (pid 10 ")
    assert tr.exit_code({1: f(-9, 11), 0: f(-9, 10)})[1].startswith("error: rank 1 (pid 11 ")  # dict order: first
    # no signal death but torchrun's own stop: no lost rank here; the peer's line is the one to print
    assert tr.exit_code({0: peer, 1: f(-15, 11)}) == (75, peer.message["message"])
    assert tr.exit_code({1: f(-9, 11)}, killed=True)[0] == 1  # the launcher's own kill after GRACE_S


def test_an_outside_failure_one_rank_met_alone_is_its_line():
    """grpo.errors.outside_exit leaves the line in every failing rank's error file (torchelastic's format): printed by
    the launcher when rank 0 did not print it (stopped by torchrun while waiting for its peer), else not again."""
    line = "error: checkpoint: no space left"
    said = lambda code, t, m: SimpleNamespace(exitcode=code, timestamp=t, message=m)  # noqa: E731
    assert tr.exit_code({0: said(-15, 6, "Signal 15"), 1: said(1, 5, {"message": line})}) == (1, line)
    assert tr.exit_code({0: said(1, 6, {"message": line}), 1: said(1, 5, {"message": line})}) == (1, None)


def test_a_rank_that_ended_because_its_peer_had_is_no_cause():
    """grpo.errors.peer_lost_exit's ranks (75, "error: a collective failed ..." in their error file) follow from
    another rank's end: its code and line win; alone (that rank ran on another machine) they are the line to print."""
    said = lambda code, m: SimpleNamespace(exitcode=code, pid=1, timestamp=5, message={"message": m})  # noqa: E731
    follow = said(75, "error: a collective failed (Connection closed by peer): another rank died")
    disk = "error: output_dir: cannot write /x (metrics): Read-only file system (EROFS); ..."
    assert tr.exit_code({0: follow, 1: follow}) == (75, follow.message["message"])
    assert tr.exit_code({0: follow, 1: said(1, disk)}) == (1, disk)  # rank 1 met it alone and printed nothing
    assert tr.exit_code({0: said(1, disk), 1: follow}) == (1, None)  # rank 0 printed it
    stuck = SimpleNamespace(exitcode=-9, pid=2, timestamp=5, message="Signal 9")  # SIGKILLed by torchrun after it
    assert tr.exit_code({0: said(1, disk), 1: stuck}) == (1, None)


def test_bad_grace_period_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("GRACE_S", "soon")
    assert tr.main(["x.py"]) == 2
    assert capsys.readouterr().err.startswith("error: GRACE_S: 'soon';")


def test_rank_exit_names_the_line_as_a_plain_torchruns_root_cause(tmp_path, monkeypatch, capsys):
    """Rank 0 prints the line once; every rank leaves it in torchelastic's error file, which torchrun's
    ChildFailedError report shows as the root cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from grpo.errors import rank_exit

    files = {rank: tmp_path / f"error{rank}.json" for rank in (0, 1)}
    for rank, path in files.items():
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        assert rank_exit("error: optim.lr: must be > 0, got 0.0; e.g. 3e-4", 2) == 2
    assert capsys.readouterr().err == "error: optim.lr: must be > 0, got 0.0; e.g. 3e-4\n"
    assert files[1].exists()  # printed by the launcher if torchrun stops rank 0 before it printed
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=2, error_file=str(files[r])) for r in files}
    root_rank, root = ChildFailedError("recipe", failures).get_first_failure()
    assert root_rank == 0
    report = ChildFailedError("recipe", failures).format_msg()
    assert "traceback : error: optim.lr: must be > 0, got 0.0; e.g. 3e-4 (exit 2: bad input;" in report
    assert report.count("(exit 2: bad input;") == 2  # the root cause, and rank 1 among the other failures


def test_deepspeed_launchers_workers_and_exit_code():
    """tools/deepspeed_run.py (launch/multinode.sh hostfile form): only a ``python -m deepspeed.launcher.launch``
    process's children are workers (pdsh's command line carries the same words); 0, 2, 3 pass, the rest is 1."""
    from tools.deepspeed_run import exit_code, is_launch

    assert is_launch(["/usr/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30="])
    assert not is_launch(["pdsh", "-S", "-f", "1024", "-w", "a,b", "cd /x;", "python", "-u", "-m",
                          "deepspeed.launcher.launch"])
    assert not is_launch(["python", "-m", "deepspeed.launcher.runner", "--hostfile", "h"])
    assert [exit_code(c, False)[0] for c in (0, 2, 3, 75, 1, 200, 241, -15)] == [0, 2, 3, 75, 1, 1, 1, 1]
    assert exit_code(241, False)[1].startswith("[launch] the DeepSpeed launcher exited with code 241")  # SIGTERM
    # 256 - signal: a worker killed by it (kill -9, a segfault), a lost rank
    assert [exit_code(c, False)[0] for c in (247, 245)] == [75, 75]
    assert exit_code(247, False)[1].startswith("error: a worker was killed by signal 9 (SIGKILL; the DeepSpeed ")
    assert exit_code(0, True) == (1, None)  # killed after the grace period: its own line was printed
