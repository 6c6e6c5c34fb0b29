"""trainers.elastic_drill: its refusals and the node kill (agent and the worker under it).

The drill end to end is what makes the published ``logs/elastic_*`` runs (3 agents, one
killed, one added); test_elastic.py covers the agents' behaviour itself.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from trainers.elastic_drill import DrillError, _descendants, _kill_node, run_drill

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
