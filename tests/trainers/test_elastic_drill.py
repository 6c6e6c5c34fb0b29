"""trainers.elastic_drill: its refusals and the node kill (agent and the worker under it).

The drill end to end is what makes the published ``logs/elastic_*`` runs (3 agents, one
killed, one added); test_elastic.py covers the agents' behaviour itself.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from trainers.elastic_drill import (
    DrillError,
    _descendants,
    _kill_node,
    main,
    parse_partition,
    parse_slow_node,
    run_drill,
)

CMD = ["scripts/train_imagenet.py", "--run-log", "x.jsonl"]


@pytest.mark.parametrize(
    ("command", "kwargs", "message"),
    [
        (CMD, {"nodes": 2, "kill_at_step": 5, "join_at_step": 9}, "at least 3"),
        (CMD, {"kill_at_step": 9, "join_at_step": 5}, "must come after"),
        (CMD, {"kill_at_step": 5, "join_at_step": 9, "kill_node": 3}, "--kill-node 3"),
        (["train.sh"], {"kill_at_step": 5, "join_at_step": 9}, "training command"),
        ([*CMD, "--elastic-dir", "d"], {"kill_at_step": 5, "join_at_step": 9}, "--elastic-dir"),
        (CMD[:1], {"kill_at_step": 5, "join_at_step": 9}, "--run-log"),
    ],
)
def test_refusals_name_the_flag(command, kwargs, message):
    with pytest.raises(DrillError, match=message):
        run_drill(command, **kwargs)


def test_refuses_to_overwrite_a_run_log(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text('{"kind": "header"}\n')
    with pytest.raises(DrillError, match="exists"):
        run_drill(["s.py", "--run-log", str(log)], kill_at_step=5, join_at_step=9)
    assert log.read_text() == '{"kind": "header"}\n'


def test_kill_node_reaches_a_worker_in_its_own_session():
    # an "agent" whose child starts a new session, as torchrun's workers do
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); time.sleep(60)"
    )
    agent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 20
    while not (workers := _descendants(agent.pid)):
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    _kill_node(agent)
    assert agent.returncode is not None
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"worker {workers} survived the node's death"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- --netlab: refusals are one line naming the flag, exit 2 (no lab is made) ------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--netlab"], "--partition NODE:STEP:SECONDS or --slow-node"),
        (["--netlab", "--partition", "2:20"], "--partition '2:20'"),
        (["--netlab", "--partition", "2:x:20"], "--partition '2:x:20'"),
        (["--netlab", "--partition", "2:20:0"], "--partition '2:20:0'"),
        (["--netlab", "--partition", "3:20:5"], "--partition: node 3"),
        (["--netlab", "--nodes", "2", "--partition", "1:20:5"], "--nodes 2"),
        (["--netlab", "--slow-node", "2:fast"], "--slow-node '2:fast'"),
        (["--netlab", "--slow-node", "5:100mbit"], "--slow-node: node 5"),
        (["--netlab", "--slow-node", "2:100mbit", "--bandwidth", "lots"], "--bandwidth"),
        (["--netlab", "--partition", "2:20:5", "--min-nodes", "4"], "--min-nodes 4"),
        (["--netlab", "--partition", "2:20:5", "--kill-at-step", "5"], "--kill-at-step"),
        (["--partition", "2:20:5", "--kill-at-step", "5"], "--partition: only with --netlab"),
        (["--slow-node", "2:1mbit", "--kill-at-step", "5"], "--slow-node: only with --netlab"),
        (["--store-on", "node0", "--kill-at-step", "5"], "--store-on: only with --netlab"),
        ([], "--kill-at-step: required"),
    ],
)
def test_netlab_refusals_name_the_flag_and_exit_2(flags, message, capsys, tmp_path):
    run_log = tmp_path / "x.jsonl"
    assert main([*flags, "--", "scripts/train_imagenet.py", "--run-log", str(run_log)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not run_log.exists()


def test_partition_and_slow_node_parse():
    assert parse_partition("2:40:20") == (2, 40, 20.0)
    assert parse_partition("0:0:1.5") == (0, 0, 1.5)
    assert parse_slow_node("2:100mbit") == (2, "100mbit")
