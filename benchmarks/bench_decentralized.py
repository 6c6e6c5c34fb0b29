"""Average vs SGP vs AD-PSGD (async) vs Pipe-SGD under an injected slow link and straggler.

Loopback is not a slow network and these 2 cores are not a cluster, so both effects are
injected (specs/decentralized.md, "Measuring honestly"):

* **compute**: every step sleeps ``--compute-ms`` before its (small, real) forward and
  backward, so ``T_c`` is set and the ranks do not fight over the cores;
* **slow link**: every message arrives ``--delay-ms`` after it was posted: an asynchronous
  all-reduce or receive completes no earlier than that, a blocking all-reduce or send takes
  that much longer, and DDP's gradient bucket (one, for this model) is delayed by a comm hook;
* **straggler**: rank 0's compute sleep is ``--straggler`` times longer.

``--world`` ranks (gloo, 127.0.0.1) train the same digits MLP with each mode in turn, in
paired rounds (every mode once per round and scenario), then evaluate on the held-out
digits. Printed per scenario and mode: the fast ranks' step time (min / median / max over the
rounds of each round's mean step inside the epochs; the slowest fast rank), the straggler's, the ratio to ``average`` in the same round
(median), the held-out top-1 and the step time that ``scripts/scaling_whatif.py``'s cost
model predicts, with its relative error: ``T_c`` = the injected compute plus that mode's own
real work per step (its no-delay step time minus the injected compute; the straggler slows
only the injected part), ``T_m`` = the injected delay (one per step; two for an AD-PSGD
exchange, which its thread makes off the critical path).

Usage: python benchmarks/bench_decentralized.py [--world 4] [--rounds 3] [--epochs 3]
           [--compute-ms 20] [--delay-ms 20] [--straggler 2] [--modes average,pipesgd,...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import check_rounds, machine_line

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = {  # name -> (--grad-combine, options, the cost model's method)
    "average": ("average", {}, "average"),
    "pipesgd": ("pipesgd", {}, "pipesgd"),
    "sgp": ("sgp", {}, "sgp"),
    "sgp-overlap1": ("sgp", {"overlap": 1}, "sgp-overlap"),
    "adpsgd-async": ("adpsgd", {"asynchronous": True}, "adpsgd-async"),
}
SCENARIOS = ("no delay", "slow link", "straggler")


def _whatif():
    spec = importlib.util.spec_from_file_location("whatif", ROOT / "scripts" / "scaling_whatif.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["whatif"] = module
    spec.loader.exec_module(module)
    return module


# ================================================================================================
# one rank
# ================================================================================================
class _Injection:
    delay = 0.0  # seconds per message


def _patch_collectives() -> None:
    """Make every message of torch.distributed arrive ``_Injection.delay`` late."""
    import torch.distributed as dist

    orig = {n: getattr(dist, n) for n in ("all_reduce", "irecv", "send", "broadcast")}

    class Late:
        def __init__(self, work, due: float) -> None:
            self.work, self.due = work, due

        def wait(self, timeout=None):  # noqa: ANN001
            self.work.wait()
            left = self.due - time.perf_counter()
            if left > 0:
                time.sleep(left)
            return True

        def is_completed(self) -> bool:
            return self.work.is_completed() and time.perf_counter() >= self.due

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001
        if async_op:
            return Late(orig["all_reduce"](tensor, op, group, True), time.perf_counter() + _Injection.delay)  # fmt: skip
        orig["all_reduce"](tensor, op, group)
        time.sleep(_Injection.delay)

    def broadcast(tensor, src=None, group=None, async_op=False, **kw):  # noqa: ANN001
        if async_op:
            return Late(orig["broadcast"](tensor, src, group, True, **kw), time.perf_counter() + _Injection.delay)  # fmt: skip
        orig["broadcast"](tensor, src, group, **kw)
        time.sleep(_Injection.delay)

    def irecv(tensor, src=None, group=None, tag=0, **kw):  # noqa: ANN001
        return Late(orig["irecv"](tensor, src, group, tag, **kw), time.perf_counter() + _Injection.delay)  # fmt: skip

    def send(tensor, dst=None, group=None, tag=0, **kw):  # noqa: ANN001
        time.sleep(_Injection.delay)
        return orig["send"](tensor, dst, group, tag, **kw)

    dist.all_reduce, dist.broadcast, dist.irecv, dist.send = all_reduce, broadcast, irecv, send
    _patch_collectives.orig = orig  # type: ignore[attr-defined]


def _delayed_ddp_hook(world: int):
    orig = _patch_collectives.orig  # type: ignore[attr-defined]

    def hook(state, bucket):  # noqa: ANN001
        posted = time.perf_counter()
        fut = orig["all_reduce"](bucket.buffer().div_(world), async_op=True).get_future()

        def done(f):  # noqa: ANN001
            left = posted + _Injection.delay - time.perf_counter()
            if left > 0:
                time.sleep(left)
            return f.value()[0]

        return fut.then(done)

    return hook


class _Clock:
    """Step durations inside the epochs (no evaluation in them), the first two skipped."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.stamps: list[float] = []

    def on_epoch_start(self, trainer, epoch) -> None:  # noqa: ANN001
        self.stamps = []

    def on_step_end(self, trainer, step) -> None:  # noqa: ANN001
        now = time.perf_counter()
        if len(self.stamps) >= 2:  # the first steps of an epoch warm up
            self.steps.append(now - self.stamps[-1])
        self.stamps.append(now)


def _worker(out: Path, args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from tests.trainers._adasum_worker import digits_sets
    from tests.trainers._trainer_toys import eval_step, train_step
    from trainers import DistEnv, RunLogger, Trainer, TrainerConfig, create_combiner

    torch.set_num_threads(1)
    _patch_collectives()
    train, val = digits_sets()
    results = []
    with DistEnv.from_env(device="cpu") as env:
        for rnd in range(args.rounds):
            for scenario in SCENARIOS:
                for name in args.modes:
                    mode, options, _ = MODES[name]
                    slow = args.straggler if scenario == "straggler" and env.rank == 0 else 1.0
                    pause = args.compute_ms / 1e3 * slow

                    def step(model, batch, pause=pause):  # noqa: ANN001
                        time.sleep(pause)
                        return train_step(model, batch)

                    clock = _Clock()

                    torch.manual_seed(0)
                    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
                    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                    trainer = Trainer(
                        model, opt,
                        TrainerConfig(epochs=args.epochs, batch_size=16, seed=rnd, log_interval=0, progress=False),
                        env=env, logger=RunLogger(None, enabled=False), train_step=step,
                        eval_step=eval_step, combiner=create_combiner(mode, seed=rnd, **options),
                        hooks=[clock],
                    )  # fmt: skip
                    if mode == "average":
                        trainer.combiner.ddp.register_comm_hook(
                            None, _delayed_ddp_hook(env.world_size)
                        )
                    _Injection.delay = args.delay_ms / 1e3 if scenario == "slow link" else 0.0
                    trainer.fit(train)
                    _Injection.delay = 0.0
                    top1 = trainer.evaluate(val)["top1"]
                    results.append({
                        "round": rnd, "scenario": scenario, "mode": name, "rank": env.rank,
                        "step": statistics.mean(clock.steps), "top1": top1,
                    })  # fmt: skip
        gathered = env.all_gather_object(results)
        if env.rank == 0:
            (out / "results.json").write_text(json.dumps([r for rs in gathered for r in rs]))


# ================================================================================================
# the driver
# ================================================================================================
def _launch(args: argparse.Namespace, out: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world),
                   LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", str(out), *sys.argv[1:]]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"bench_decentralized.py: a rank failed (exit codes {codes})")


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    whatif = _whatif()
    straggler_rank = 0

    def cell(scenario, mode, rnd, fast=True):  # noqa: ANN001
        got = [r["step"] for r in rows if (r["scenario"], r["mode"], r["round"]) == (scenario, mode, rnd)
               and ((r["rank"] != straggler_rank) if fast else (r["rank"] == straggler_rank))]  # fmt: skip
        return max(got)  # the slowest of the fast ranks (or the straggler itself)

    rounds = sorted({r["round"] for r in rows})
    delay, compute = args.delay_ms / 1e3, args.compute_ms / 1e3
    print(machine_line())
    print(f"{args.world} ranks, compute {args.compute_ms} ms/step (injected), slow link "
          f"{args.delay_ms} ms/message, straggler rank 0 x{args.straggler}; {len(rounds)} paired "
          "rounds; step times in ms (min / median / max over rounds)")  # fmt: skip
    worst = 0.0
    for scenario in SCENARIOS:
        print(f"\n== {scenario}")
        print(f"{'mode':<14}{'fast ranks':>24}{'straggler':>12}{'vs average':>12}{'top-1':>8}"
              f"{'predicted':>11}{'error':>8}")  # fmt: skip
        for mode in args.modes:
            fast = [cell(scenario, mode, r) for r in rounds]
            slow = [cell(scenario, mode, r, fast=False) for r in rounds]
            ratio = [cell(scenario, mode, r) / cell(scenario, "average", r) for r in rounds]
            top1 = statistics.mean(r["top1"] for r in rows if (r["scenario"], r["mode"]) == (scenario, mode) and r["rank"] == 0)  # fmt: skip
            # T_c: the injected compute plus the mode's own real work per step (its no-delay
            # step time minus the injected compute: the small forward/backward, loopback
            # messages); the straggler slows the injected part only.
            base = statistics.median(cell("no delay", mode, r) for r in rounds)
            real = max(0.0, base - compute)
            method = MODES[mode][2]
            comm = (
                (2 * delay if method == "adpsgd-async" else delay)
                if scenario == "slow link"
                else 0.0
            )
            s = (
                (args.straggler * compute + real) / (compute + real)
                if scenario == "straggler"
                else 1.0
            )
            predicted = whatif.method_step_time(method, compute + real, comm, straggler=s)[0]
            measured = statistics.median(fast)
            err = abs(predicted - measured) / measured
            worst = max(worst, err)
            print(f"{mode:<14}{min(fast) * 1e3:>8.1f} /{measured * 1e3:>6.1f} /{max(fast) * 1e3:>6.1f}"
                  f"{statistics.median(slow) * 1e3:>12.1f}{statistics.median(ratio):>11.2f}x"
                  f"{top1:>8.3f}{predicted * 1e3:>11.1f}{err:>8.1%}")  # fmt: skip
    print(f"\nmax_rel_error={worst:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5, help="paired rounds (>= 5)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--straggler", type=float, default=2.0)
    p.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES))
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    check_rounds(args.rounds)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or "average" not in args.modes:
        p.error(f"--modes: choose among {', '.join(MODES)} (average included); got {unknown}")
    if args.worker is not None:
        _worker(args.worker, args)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-decentral-") as tmp:
        _launch(args, Path(tmp))
        rows = json.loads((Path(tmp) / "results.json").read_text())
    _report(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
