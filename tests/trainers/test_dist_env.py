"""DistEnv from torchrun's environment (faked) and from plain python."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

import trainers.dist as dist_module
from tests.trainers._launch import run_ranks
from trainers import DistEnv

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_plain_python_is_a_world_of_one(clean_env):
    env = DistEnv.from_env(device="cpu")
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (0, 0, 1, 1)
    assert env.restart_count == 0 and env.is_main and not env.distributed
    assert env.backend is None and env.device == torch.device("cpu")
    assert not dist.is_initialized()
    t = torch.tensor([1.0, 2.0])
    assert env.all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    assert env.broadcast_object({"a": 1}) == {"a": 1}
    assert env.all_gather_object(3) == [3]
    assert env.gather_object(3) == [3]
    env.barrier()
    with env as same:
        assert same is env
    assert not dist.is_initialized()


def test_fake_torchrun_environment(clean_env):
    calls = []
    clean_env.setattr(dist_module.dist, "init_process_group", lambda **kw: calls.append(kw))
    for name, value in {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }.items():
        clean_env.setenv(name, value)
    env = DistEnv.from_env(device="cpu")
    assert calls == [{"backend": "gloo", "init_method": "env://", "rank": 3, "world_size": 4}]
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert env.restart_count == 2 and not env.is_main and env.distributed
    assert env.backend == "gloo" and env.owns_process_group


def test_missing_rendezvous_address_is_explained(clean_env):
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        DistEnv.from_env(device="cpu")


@pytest.mark.parametrize(("rank", "world"), [("2", "2"), ("x", "2")])
def test_inconsistent_environment_is_rejected(clean_env, rank, world):
    clean_env.setenv("RANK", rank)
    clean_env.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match="RANK"):
        DistEnv.from_env(device="cpu")


def test_seed_everything_is_per_rank():
    DistEnv(rank=2, world_size=4).seed_everything(10)
    got = (torch.rand(3), np.random.rand(), random.random())
    torch.manual_seed(12)
    np.random.seed(12)
    random.seed(12)
    want = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_destroy_waits_for_every_rank_unless_leaving_after_an_error(clean_env):
    """A clean ``destroy()`` (what the scripts call at the end) meets the other ranks at a
    barrier before tearing the process group down: a rank that finished first and closed its
    gloo connections while a peer still used them aborted that peer at exit, about 1 exit in
    36 ("terminate called without an active exception"). After an error there is no barrier
    (a peer may never arrive)."""
    calls = []
    clean_env.setattr(dist_module.dist, "is_initialized", lambda: True)
    clean_env.setattr(dist_module.dist, "barrier", lambda *a, **k: calls.append("barrier"))
    clean_env.setattr(dist_module.dist, "destroy_process_group", lambda: calls.append("destroy"))
    env = DistEnv(rank=1, world_size=2, backend="gloo", owns_process_group=True)
    env.destroy()
    assert calls == ["barrier", "destroy"]
    calls.clear()
    env.destroy(barrier=False)
    assert calls == ["destroy"]
    calls.clear()
    with pytest.raises(KeyError), env:
        raise KeyError("a failing step")
    assert calls == ["destroy"]
    calls.clear()
    DistEnv(rank=1, world_size=2, backend="gloo", owns_process_group=False).destroy()
    assert calls == []  # a process group the caller made is left alone


@pytest.mark.slow  # two processes
def test_ranks_whose_agents_restarted_differently_leave_together_at_once():
    """Each torchrun agent counts its own restarts, so one group's members can carry different
    ``TORCHELASTIC_RESTART_COUNT`` s (after a partition). The closing handshake's key must be
    the group's, not each member's: with per-member keys every rank waited out its 60 s."""
    outputs = run_ranks("tests.trainers._leave_worker", [], world=2, timeout=120)
    for rank, out in enumerate(outputs):
        match = re.search(rf"rank {rank} left in ([0-9.]+) s", out)
        assert match, out
        assert float(match.group(1)) < 20, out
