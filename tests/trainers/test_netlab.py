"""The lab network (trainers.netlab): it builds what it says, touches nothing else, removes
everything, and a job across it computes what the same job computes on loopback.

Oracles: the kernel's own view of the namespaces (``ip``/``tc`` JSON), the root namespace's
links, addresses and routes before and after, and the same processes run on loopback (gloo
on 127.0.0.1, torchrun --standalone): the network changes time, never arithmetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainers._launch import REPO, free_port, run_ranks
from trainers.netlab import LAB_NETWORK, Lab, list_labs, missing_requirements, start_ranks
from trainers.netlab import lab as lab_module

WHY = missing_requirements()
pytestmark = [pytest.mark.netlab, pytest.mark.skipif(WHY is not None, reason=f"netlab: {WHY}")]


def _name(tag: str) -> str:
    return f"t{tag}{os.getpid() % 100000}"


def _ip_json(*args: str, ns: str | None = None) -> list:
    cmd = ["ip", *(["-n", ns] if ns else []), "-j", *args]
    return json.loads(
        subprocess.run(cmd, capture_output=True, text=True, check=True).stdout or "[]"
    )


def _root_state() -> tuple:
    def stable(links):  # counters move; everything else must not
        return [{k: v for k, v in link.items() if k not in ("stats", "stats64")} for link in links]

    return (stable(_ip_json("link")), _ip_json("addr"), _ip_json("route"),
            _ip_json("-6", "route"), sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns")
            else [])  # fmt: skip


def _netlab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainers.netlab", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_a_lab_is_what_it_says_and_leaves_nothing_behind():
    before_root = _root_state()
    name = _name("a")
    with Lab(3, bandwidth="100mbit", slow={2: "10mbit"}, name=name) as lab:
        spaces = sorted(list_labs()[name])
        assert spaces == sorted([lab.switch, *(lab.namespace(i) for i in range(3))])
        for node in range(3):
            ns = lab.namespace(node)
            (eth,) = [a for a in _ip_json("addr", ns=ns) if a["ifname"] == "eth0"]
            inet = [a for a in eth["addr_info"] if a["family"] == "inet"]
            assert [a["local"] for a in inet] == [lab.address(node)]
            assert not [a for a in eth["addr_info"] if a["family"] == "inet6"], "IPv6 is off"
            assert all(
                __import__("ipaddress").ip_address(a["local"]) in LAB_NETWORK for a in inet)  # fmt: skip
            routes = _ip_json("route", ns=ns)
            assert [r["dst"] for r in routes] == ["198.18.0.0/24"], "no route out of the lab"
            # the cap: one tbf each way (the node's egress and its switch port's egress)
            rate = {0: 100e6, 1: 100e6, 2: 10e6}[node]
            for where, dev in ((ns, "eth0"), (lab.switch, f"port{node}")):
                tbf = [q for q in json.loads(subprocess.run(
                    ["tc", "-n", where, "-j", "qdisc", "show", "dev", dev],
                    capture_output=True, text=True, check=True).stdout) if q["kind"] == "tbf"]  # fmt: skip
                assert len(tbf) == 1, (where, dev)
                assert tbf[0]["options"]["rate"] * 8 == rate
                assert tbf[0]["options"]["burst"] >= max(64 * 1024, rate / 8 * 0.004)
        bridge = [link for link in _ip_json("-d", "link", "show", "br0", ns=lab.switch)]
        assert bridge[0]["linkinfo"]["info_data"]["stp_state"] == 0
        ports = {link["ifname"]: link.get("master") for link in _ip_json("link", ns=lab.switch)}
        assert all(ports[f"port{i}"] == "br0" for i in range(3))
        # reachable inside, unreachable outside
        probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2)"
        server = lab.popen(1, [sys.executable, "-c",
                               "import socket,sys; s=socket.create_server((sys.argv[1], 7000)); "
                               "s.accept()", lab.address(1)])  # fmt: skip
        try:
            for _ in range(50):
                if lab.run(0, [sys.executable, "-c", probe, lab.address(1), "7000"],
                           check=False).returncode == 0:  # fmt: skip
                    break
            else:
                pytest.fail("node 0 cannot reach node 1 across the lab")
        finally:
            server.kill()
            server.wait()
        out = lab.run(0, [sys.executable, "-c", probe, "8.8.8.8", "53"], check=False)
        assert out.returncode != 0 and "unreachable" in out.stderr
        assert _root_state()[:4] == before_root[:4], "the root namespace changed"
    assert name not in list_labs()
    assert _root_state() == before_root


def test_a_partition_cuts_one_node_and_counters_count_what_crossed():
    with Lab(2, bandwidth="1gbit", name=_name("p")) as lab:
        server = (
            "import socket,sys\n"
            "s=socket.create_server((sys.argv[1],7001)); c,_=s.accept(); n=0\n"
            "while (b:=c.recv(1<<16)): n+=len(b)\n"
            "print(n)\n"
        )
        client = (
            "import socket,sys,time\n"
            "for _ in range(100):\n"
            "    try: s=socket.create_connection((sys.argv[1],7001),1); break\n"
            "    except OSError: time.sleep(0.05)\n"
            "s.sendall(b'x'*int(sys.argv[2])); s.close()\n"
        )
        before = lab.all_counters()
        srv = lab.popen(1, [sys.executable, "-c", server, lab.address(1)],
                        stdout=subprocess.PIPE, text=True)  # fmt: skip
        lab.run(0, [sys.executable, "-c", client, lab.address(1), str(5_000_000)])
        assert int(srv.communicate(timeout=30)[0]) == 5_000_000
        sent = lab.counters(0) - before[0]
        received = lab.counters(1) - before[1]
        # 5 MB of payload plus TCP/IP headers: between the payload and +10 %
        assert 5_000_000 <= sent.tx_bytes <= 5_500_000, sent
        assert 5_000_000 <= received.rx_bytes <= 5_500_000, received
        lab.set_link(1, up=False)
        probe = "import socket,sys; socket.create_connection((sys.argv[1], 7002), 1.5)"
        cut = lab.run(0, [sys.executable, "-c", probe, lab.address(1)], check=False)
        assert "timed out" in cut.stderr, "a pulled cable is a black hole, not a refusal"
        lab.set_link(1, up=True)
        back = lab.run(0, [sys.executable, "-c", probe, lab.address(1)], check=False)
        assert "refused" in back.stderr, "with the link back, node 1 answers (nothing listens)"


@pytest.mark.slow
def test_a_gloo_allreduce_across_the_lab_equals_loopback(tmp_path):
    loop, lab_out = tmp_path / "loopback", tmp_path / "lab"
    loop.mkdir()
    lab_out.mkdir()
    run_ranks("tests.trainers._netlab_allreduce_worker", [str(loop)], world=2, timeout=120)
    with Lab(2, bandwidth="1gbit", name=_name("g")) as lab:
        before = lab.all_counters()
        procs = start_ranks(lab, [sys.executable, "-m", "tests.trainers._netlab_allreduce_worker",
                                  str(lab_out)], port=free_port(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outputs
        sent = [(a - b).tx_bytes for a, b in zip(lab.all_counters(), before, strict=True)]
    values = 3 + 1000 + 250_000 + 1_000_003
    for rank in range(2):
        a = torch.load(loop / f"rank{rank}.pt", weights_only=True)
        b = torch.load(lab_out / f"rank{rank}.pt", weights_only=True)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
        # each rank sends at least half the buffer of float32s in a 2-rank all-reduce
        assert sent[rank] >= values * 4 / 2, sent


def _records(path: Path, kinds=("step", "epoch", "eval")) -> list[dict]:
    drop = {"samples_per_sec", "time_cost", "total_time", "time"}
    return [{k: v for k, v in r.items() if k not in drop}
            for r in map(json.loads, path.read_text().splitlines()) if r["kind"] in kinds]  # fmt: skip


@pytest.fixture(scope="module")
def loopback_digits(tmp_path_factory):
    """The digits recipe's first 12 steps as 2 processes on loopback (torchrun --standalone)."""
    out = tmp_path_factory.mktemp("loop") / "loop.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "scripts/train_imagenet.py", *DIGITS, "--run-log", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _records(out)


DIGITS = ["--batch-size", "32", "-j", "0", "--no-progress", "--seed", "0", "--max-steps", "12",
          "--log-interval", "1"]  # fmt: skip


@pytest.mark.slow
def test_the_digits_recipe_on_two_lab_nodes_gives_the_loopback_trace(tmp_path, loopback_digits):
    log = tmp_path / "lab.jsonl"
    done = _netlab("run", "--nodes", "2", "--bandwidth", "1gbit", "--timeout", "240",
                   "--", "scripts/train_imagenet.py", *DIGITS, "--run-log", str(log))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = _records(log)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 13))
    assert records == loopback_digits
    header = json.loads(log.read_text().splitlines()[0])
    assert header["world_size"] == 2
    assert header["network"] == {"netlab": True, "nodes": 2, "caps": ["1gbit", "1gbit"]}
    report = json.loads(log.with_suffix(".netlab.json").read_text())
    assert report["exit_codes"] == [0, 0] and not report["timed_out"]
    # measured on the cables: at least the gradients the trainer says it all-reduced (each
    # rank sends at least half of every step's buffer in a 2-rank ring)
    grad_bytes = sum(r["grad_bytes"] for r in records if r["kind"] == "step")
    for node in range(2):
        assert report["tx_bytes"][node] >= grad_bytes / 2, report
        assert report["rx_bytes"][node] >= grad_bytes / 2, report
    assert "sent MB" in done.stdout and not list_labs().get(f"r{os.getpid()}")


@pytest.mark.slow
def test_a_short_cut_of_a_static_job_changes_its_time_not_its_trace(tmp_path, loopback_digits):
    """The cable of node 1 pulled for 3 s at step 4: TCP holds the connections, the job
    waits, then goes on with exactly the loopback trace."""
    log = tmp_path / "cut.jsonl"
    done = _netlab("run", "--nodes", "2", "--bandwidth", "1gbit", "--timeout", "240",
                   "--partition-node", "1", "--partition-at-step", "4", "--partition-for", "3",
                   "--", "scripts/train_imagenet.py", *DIGITS, "--run-log", str(log))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(log.with_suffix(".netlab.json").read_text())
    cut = report["partition"]
    assert cut["node"] == 1 and 4 <= cut["cut_at_step"] < 12, cut
    assert cut["up_at_s"] - cut["cut_at_s"] >= 3
    assert _records(log) == loopback_digits


@pytest.mark.slow
def test_refusals_are_one_line_with_exit_2(tmp_path):
    cases = [
        (["up", "--nodes", "2", "--slow-node", "5:100mbit", "--name", _name("r")], "--slow-node 5"),
        (["up", "--bandwidth", "1gbps"], "1gbps"),
        (["up", "--nodes", "1"], "2 to 99"),
        (["run", "--nodes", "2"], "after --"),
        (["run", "--partition-node", "1", "--", "scripts/train_imagenet.py"],
         "--partition-at-step or --partition-at-time"),
        (["run", "--partition-node", "1", "--partition-at-step", "3", "--",
          "scripts/train_imagenet.py"], "--run-log"),
        (["run", "--", "scripts/no_such.py"], "no such script"),
        (["status", "--name", "nosuchlab"], "no lab named"),
    ]  # fmt: skip
    for args, words in cases:
        done = _netlab(*args, timeout=60)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert words in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert not any(name.startswith("tr") for name in list_labs())


@pytest.mark.slow
def test_an_existing_lab_is_refused_and_down_removes_it_by_its_prefix():
    name = _name("d")
    assert _netlab("up", "--nodes", "2", "--name", name).returncode == 0
    try:
        again = _netlab("up", "--nodes", "2", "--name", name)
        assert again.returncode == 2 and f"a lab named {name!r} exists" in again.stderr
        status = json.loads(_netlab("status", "--name", name, "--json").stdout)
        assert [r["address"] for r in status[name]] == ["198.18.0.100", "198.18.0.101"]
        # a process left running in a node is stopped by down
        sleeper = subprocess.Popen(["ip", "netns", "exec", f"mzlab-{name}-n1", "sleep", "300"])
        down = _netlab("down", "--name", name)
        assert down.returncode == 0 and "removed 3 namespaces" in down.stdout
        assert sleeper.wait(timeout=10) != 0
    finally:
        lab_module.remove_labs(name)
    assert name not in list_labs()


@pytest.mark.slow
def test_a_job_that_outlives_its_timeout_is_stopped_and_the_lab_removed(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    done = _netlab("run", "--nodes", "2", "--timeout", "8", "--name", _name("h"), "--",
                   str(script), timeout=120)  # fmt: skip
    assert done.returncode == 124, done.stdout + done.stderr
    assert "timed out after 8 s" in done.stdout
    assert _name("h") not in list_labs()
    leftover = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "a process of the job outlived it"


def test_without_the_capabilities_it_refuses_in_one_line(tmp_path):
    done = subprocess.run(
        ["setpriv", "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-net_admin,-sys_admin",
         sys.executable, "-m", "trainers.netlab", "up"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "netlab: needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN missing): run it as root, e.g. with sudo"
    ]


def test_without_iproute2_it_refuses(monkeypatch):
    monkeypatch.setattr(lab_module, "_tool", lambda name: None if name == "tc" else "/usr/sbin/ip")
    assert lab_module.missing_requirements() == (
        "needs iproute2 (tc not found): apt-get install iproute2"
    )
