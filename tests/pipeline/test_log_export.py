"""``inflight logs``: ``--csv`` export, and ``-f`` ending when the run's supervisor is gone."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import signal
import subprocess

import pytest

from pipeline.log_view import LogTail, add_logs_arguments, process_identity, run_logs
from tests.pipeline.runs import (
    alive,
    inflight_cmd,
    kill_tree,
    spawned_pids,
    start_endless_example,
    wait_for,
)
from tests.pipeline.test_log_view import append, ev


def logs_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_logs_arguments(parser)
    return run_logs(parser.parse_args(list(argv)))


def test_csv_has_every_field_in_order_of_first_appearance(tmp_path, capsys):
    logs = tmp_path / "logs"
    append(
        logs / "learner.0.jsonl",
        ev(1, "learner.0", "train_step", step=1, reward=0.5, lag=0.0),
        ev(2, "learner.0", "eval", step=1, accuracy=0.6),
        ev(3, "learner.0", "train_step", step=2, reward=0.75, lag=1.5, grad_norm=0.3),
    )
    append(
        logs / "generator.0.jsonl",
        ev(2.5, "generator.0", "train_step", step=9, note='a, "quoted"', ok=True, ids=[1, 2]),
    )
    assert logs_cli(str(tmp_path), "--event", "train_step", "--csv") == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    head = ["ts", "level", "event", "stage", "replica", "version", "step", "reward", "lag"]
    assert rows[0] == [*head, "note", "ok", "ids", "grad_norm"]
    assert [r[6] for r in rows[1:]] == ["1", "9", "2"]  # ts order across files
    assert rows[1][7:] == ["0.5", "0.0", "", "", "", ""]  # absent fields are empty
    assert rows[2][9:12] == ['a, "quoted"', "true", "[1,2]"]
    assert rows[3][-1] == "0.3"


def test_csv_refuses_follow(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    assert logs_cli(str(tmp_path), "--csv", "-f") == 2
    assert "--csv" in capsys.readouterr().err


def test_tail_knows_whether_the_supervisor_of_the_run_lives(tmp_path):
    sup = tmp_path / "logs" / "supervisor.jsonl"
    me = process_identity()
    append(sup, ev(0, "supervisor", "run_started"))  # no pid (an old log): cannot tell
    tail = LogTail(tmp_path)
    tail.poll()
    assert tail.supervisor_gone() is None
    append(sup, ev(1, "supervisor", "run_started", **me))
    tail.poll()
    assert tail.supervisor_gone() is None  # this very process: alive
    append(sup, ev(2, "supervisor", "run_finished"), ev(3, "supervisor", "run_started", **me))
    tail.poll()
    assert not tail.finished  # a resumed run goes on in the same files
    reused = {**me, "pid_start": me["pid_start"] + 1} if me["pid_start"] else None
    if reused is not None:  # the pid now belongs to a process that started at another time
        append(sup, ev(4, "supervisor", "run_started", **reused))
        tail.poll()
        assert tail.supervisor_gone() == me["pid"]
    append(sup, ev(5, "supervisor", "run_started", **{**me, "host": "elsewhere.example"}))
    assert LogTail(tmp_path, from_start=False).supervisor_gone() is None  # another host
    append(sup, ev(6, "supervisor", "run_started", **{**me, "pid": 2**22 + 7}))
    late = LogTail(tmp_path, from_start=False)  # joins late: still finds the latest run_started
    assert late.supervisor_gone() == 2**22 + 7 and not late.finished


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_follow_ends_when_the_supervisor_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_endless_example(run_dir)
    follower = None
    try:
        follower = subprocess.Popen(
            inflight_cmd("logs", str(run_dir), "-f", "--stage", "supervisor", "--json"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = json.loads(follower.stdout.readline())  # following has begun
        assert first["event"] == "run_started" and first["pid"] == proc.pid
        os.kill(proc.pid, signal.SIGKILL)  # not reaped yet: a zombie is gone too
        out, err = follower.communicate(timeout=30)
    finally:
        kill_tree(proc, spawned_pids(run_dir))
        if follower is not None and follower.poll() is None:
            follower.kill()
    proc.wait(timeout=10)
    assert follower.returncode == 1
    assert f"the run's supervisor (pid {proc.pid}) is gone without finishing the run" in err
    assert "Traceback" not in err
    assert "run_finished" not in out
    wait_for(lambda: not any(alive(p) for p in spawned_pids(run_dir)), 10, "replicas to die")
