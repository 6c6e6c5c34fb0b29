"""One rank of test_def.py's 2-process checks of ``--grad-combine def`` (torchrun's variables).

Float64 toy runs through the Trainer, the state after every step, and next to them error
feedback on updates written from its rule with plain ``dist.all_reduce`` and ``torch.topk``;
then importance pruning's compressed all-reduce on random vectors.
Each rank saves its results in ``OUTDIR/rank{r}.pt``.

Usage: python -m tests.trainers._def_worker OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.trainers._comm_worker import (
    BATCH,
    EPOCHS,
    SEED,
    N,
    fit,
    local_batches,
    resumed_vs_straight,
)
from tests.trainers._trainer_toys import ToyDataset, lr_fn, make_mlp
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.comm import Identity, Importance, RandomBlock, TopK, compressed_allreduce
from trainers.comm.detached_ef import DEFCombiner

MOMENTUM, WD = 0.9, 1e-3


def step64(model, batch):
    x, y = batch
    logits = model(x.double())
    return F.cross_entropy(logits, y), {}


def eval64(model, batch):
    x, y = batch
    logits = model(x.double())
    return {"top1": (logits.argmax(1) == y).sum(), "count": y.numel()}


class StateRecorder:
    """x, e_i, the momentum m_i and the lr after every optimizer step."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        c = trainer.combiner
        opt = trainer.optimizer
        m = torch.cat(
            [opt.state[p]["momentum_buffer"].reshape(-1) for p in trainer.model.parameters()]
        )
        self.records.append(
            {"x": c.synced.clone(), "e": c.error.clone(), "m": m.clone(),
             "lr": opt.param_groups[0]["lr"], "bytes": c.counter.total_bytes}
        )  # fmt: skip


class CheckpointProbe:
    """The ``model`` entry of a checkpoint taken after step 3 (a collective: every rank)."""

    model: dict | None = None

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step == 3:
            state = trainer.state_dict()
            if state is not None:
                self.model = {k: v.clone() for k, v in state["model"].items()}


def fit64(env, combiner, *, hooks=(), eval_data=None, epochs=EPOCHS):
    model = make_mlp(seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=MOMENTUM, weight_decay=WD)
    trainer = Trainer(
        model, opt,
        TrainerConfig(epochs=epochs, batch_size=BATCH, seed=SEED, log_interval=0, progress=False,
                      eval_interval=1),
        env=env, logger=RunLogger(None, enabled=False), lr_schedule=lr_fn,
        train_step=step64, eval_step=eval64, combiner=combiner, hooks=list(hooks),
    )  # fmt: skip
    trainer.fit(ToyDataset(N), eval_dataset=eval_data)
    return trainer


def reference_ef_on_updates(rank: int, ratio: float) -> torch.Tensor:
    """Error feedback on updates, from the rule: m = mu m + g + wd x; delta = e + lr m;
    c = mean_j topk(delta_j) (values sent as float32, as the wire format does); e = delta -
    topk(delta); x -= c. Every worker's model is x."""
    model = make_mlp(seed=0).double()
    params = list(model.parameters())
    x = torch.cat([p.detach().reshape(-1) for p in params])
    m = torch.zeros_like(x)
    e = torch.zeros_like(x)
    for step, (xb, yb) in enumerate(local_batches(rank)):
        for p in params:
            p.grad = None
        F.cross_entropy(model(xb.double()), yb).backward()
        g = torch.cat([p.grad.reshape(-1) for p in params])
        m = MOMENTUM * m + g + WD * x
        delta = e + lr_fn(step) * m
        k = max(1, round(ratio * x.numel()))
        idx = delta.abs().topk(k).indices
        own = torch.zeros_like(delta)
        own[idx] = delta[idx].float().double()
        c = own.clone()
        dist.all_reduce(c)
        c /= 2
        e = delta - own
        x = x - c
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(x[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
    return x


def reference_def_per_tensor(rank: int, ratio: float, coeff: float) -> list[torch.Tensor]:
    """The authors' ``optimizers/Def.py`` step with their random-block reducer
    (``all_reducer.URSB``: one block per tensor, wrapping around its end), transcribed per
    tensor with plain ``dist.all_reduce``: d = g + wd p; m = mu m + d; p -= lr m; delta +=
    lr m; then per tensor a block of ``max(1, round(ratio n))`` entries at a random start is
    averaged, error = delta off the block, old -= the averaged block, p = old - coeff error,
    delta = error. The starts are drawn as documented for ``--def-blocks tensor``: tensor
    ``i`` at step ``t`` (counted from 1) from a generator seeded with ``derive_seed(seed, t,
    i)`` (their reducer draws them from one numpy stream). Returns x after every step."""
    from trainers.data import derive_seed

    model = make_mlp(seed=0).double()
    params = list(model.parameters())
    old = [p.detach().clone() for p in params]
    delta = [torch.zeros_like(p) for p in params]
    error = [torch.zeros_like(p) for p in params]
    buf = [torch.zeros_like(p) for p in params]
    xs = []
    for step, (xb, yb) in enumerate(local_batches(rank)):
        for p in params:
            p.grad = None
        F.cross_entropy(model(xb.double()), yb).backward()
        lr = lr_fn(step)
        with torch.no_grad():
            for i, p in enumerate(params):
                d = p.grad + WD * p
                buf[i] = MOMENTUM * buf[i] + d
                p -= lr * buf[i]
                delta[i] += lr * buf[i]
            for i, p in enumerate(params):
                n = p.numel()
                size = min(n, max(1, round(ratio * n)))
                gen = torch.Generator().manual_seed(derive_seed(SEED, step + 1, i))
                start = int(torch.randint(n, (), generator=gen))
                idx = (torch.arange(size) + start) % n
                block = delta[i].reshape(-1)[idx].clone()
                dist.all_reduce(block)
                block /= dist.get_world_size()
                error[i] = delta[i].clone()
                error[i].reshape(-1)[idx] = 0.0
                c = torch.zeros(n, dtype=p.dtype)
                c[idx] = block
                old[i] -= c.view_as(p)
                p.copy_(old[i] - coeff * error[i])
                delta[i] = error[i].clone()
        xs.append(torch.cat([o.reshape(-1) for o in old]))
    return xs


def main(out: Path) -> None:
    torch.set_num_threads(1)
    with DistEnv.from_env(device="cpu") as env:
        res: dict = {}
        for name, comp, period in (
            ("randblock", RandomBlock(ratio=0.2), 1), ("topk", TopK(ratio=0.2), 1),
            ("randblock_p2", RandomBlock(ratio=0.2), 2),
            ("randblock_tensor", RandomBlock(ratio=0.1), 1),
            ("topk_tensor", TopK(ratio=0.1), 1),
        ):  # fmt: skip
            rec, probe = StateRecorder(), CheckpointProbe()
            blocks = "tensor" if name.endswith("_tensor") else "flat"
            combiner = DEFCombiner(
                compressor=comp, coeff=0.3, period=period, seed=SEED, blocks=blocks
            )
            trainer = fit64(env, combiner, hooks=[rec, probe])
            res[name] = {
                "records": rec.records,
                "final": [p.detach().clone() for p in trainer.model.parameters()],
                "x": trainer.combiner.synced.clone(),
                "e": trainer.combiner.error.clone(),
                "checkpoint_model": probe.model,
            }
        res["ref_tensor"] = reference_def_per_tensor(env.rank, 0.1, 0.3)
        # coeff 0 = error feedback on updates
        trainer = fit64(env, DEFCombiner(compressor=TopK(ratio=0.2), coeff=0.0))
        res["coeff0"] = trainer.combiner.synced.clone()  # x (the module holds x - mean(e))
        res["ref_coeff0"] = reference_ef_on_updates(env.rank, 0.2)
        # the identity: e stays 0, synchronous momentum SGD (float32, as test_compress_dist)
        res["identity"] = fit(env, DEFCombiner(compressor=Identity(), coeff=0.3))[1]
        # evaluating in the middle changes nothing in training
        with_eval = fit64(env, DEFCombiner(compressor=RandomBlock(ratio=0.2), seed=SEED),
                          eval_data=ToyDataset(10))  # fmt: skip
        without = fit64(env, DEFCombiner(compressor=RandomBlock(ratio=0.2), seed=SEED))
        res["eval"] = {
            "with": [p.detach().clone() for p in with_eval.model.parameters()],
            "without": [p.detach().clone() for p in without.model.parameters()],
            "top1": with_eval.last_eval["top1"],
        }
        res["resume"] = resumed_vs_straight(env, "def", out)

        # importance pruning: one index set per step, chosen by the drawn rank, broadcast
        g = torch.Generator().manual_seed(100 + env.rank)
        x = torch.randn(200, generator=g, dtype=torch.float64)
        w = torch.randn(200, generator=g, dtype=torch.float64)
        res["importance"] = {"x": x, "w": w}
        for name, ratio, weights in (
            ("pruned", 0.1, w), ("equal_weights", 0.1, torch.full_like(w, 0.5)), ("dense", 1.0, w)
        ):  # fmt: skip
            mean, own, sent = compressed_allreduce(
                Importance(ratio=ratio), x, env, shared=torch.Generator().manual_seed(7),
                weights=weights,
            )  # fmt: skip
            res["importance"][name] = {"mean": mean, "own": own, "sent": sent}
        torch.save(res, out / f"rank{env.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
