"""One rank of test_overlap.py (torchrun's variables set): Adasum gradient mode and bucketed
error feedback through the Trainer, with and without the backward overlap.

``python -m tests.trainers._overlap_worker OUTDIR MODE``: float32 runs of 6 steps of 2
accumulated micro-batches, buckets of about one layer, a branch used only on rank 1 and a
parameter used nowhere. MODE ``adasum``: gradient mode with and without ``overlap``. MODE
``ef``: top-k error feedback in buckets with and without ``overlap`` (recording each
bucket's local gradients, residual before the step and the applied mean), and fp16
compression in buckets against the whole-vector path. Each rank saves
``OUTDIR/rank{r}.pt`` with the runs' parameters and, per step, how many buckets the backward
hooks launched before ``reduce_gradients``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tests.trainers._trainer_toys import CLASSES, DIM, ToyDataset, lr_fn
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.comm.adasum import AdasumCombiner
from trainers.comm.ef import ErrorFeedbackCombiner

STEPS, BATCH, ACCUM = 6, 4, 2


class Net(nn.Module):
    """Four layers (one bucket each at the test's cap), a branch only rank 1 runs, and a
    parameter no rank uses."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rank = rank
        self.a = nn.Linear(DIM, 64)
        self.b = nn.Linear(64, 64)
        self.side = nn.Linear(64, 64)  # rank 1 only
        self.c = nn.Linear(64, 64)
        self.head = nn.Linear(64, CLASSES)
        self.unused = nn.Parameter(torch.ones(5))

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if self.rank == 1:
            h = h + 0.5 * torch.tanh(self.side(h))
        return self.head(torch.tanh(self.c(h)))


class Recording(AdasumCombiner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.early: list[int] = []

    def reduce_gradients(self, scaler) -> None:
        super().reduce_gradients(scaler)
        self.early.append(self._overlap.last_launched_early if self._overlap else 0)


class RecordingEF(ErrorFeedbackCombiner):
    """Per step and bucket: (step, bucket, local gradient, residual before, applied mean)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.early: list[int] = []
        self.log: list[tuple] = []

    def _reduce_bucket(self, b, grads):
        params = [self._buckets.params[i] for i in self._buckets.buckets[b]]
        local = torch.cat([g.reshape(-1) for g in grads]).clone()
        before = torch.cat([self.residual[self._views[p]] for p in params]).clone()
        super()._reduce_bucket(b, grads)
        applied = torch.cat([g.reshape(-1) for g in grads]).clone()
        self.log.append((self.steps, b, local, before, applied))

    def reduce_gradients(self, scaler) -> None:
        super().reduce_gradients(scaler)
        self.early.append(self._buckets.last_launched_early if self._buckets else 0)


def run(
    env: DistEnv, overlap: bool, combiner=None, *, steps: int = STEPS, save=None, resume=None
) -> tuple[list[torch.Tensor], list[int], list]:
    model = Net(env.rank)
    if combiner is None:
        combiner = Recording(mode="gradient", overlap=overlap, bucket_cap_mb=0.02)

    def step(m, batch):
        x, y = batch
        return F.cross_entropy(m(x), y), {}

    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9, weight_decay=1e-4),
        TrainerConfig(epochs=1, max_steps=steps, batch_size=BATCH, grad_accum_steps=ACCUM,
                      seed=1, log_interval=1, progress=False),
        env=env, logger=RunLogger(None, enabled=False), lr_schedule=lr_fn, train_step=step,
        combiner=combiner,
    )  # fmt: skip
    if resume is not None:
        trainer.resume(resume)
    trainer.fit(ToyDataset(STEPS * BATCH * ACCUM * env.world_size))
    if save is not None:
        trainer.save_checkpoint(save)
    layout = getattr(combiner, "_overlap", None) or combiner._buckets
    if layout is None:  # the whole-vector path
        return [p.detach().clone() for p in model.parameters()], [], []
    names = {p: n for n, p in model.named_parameters()}
    buckets = [[names[layout.params[i]] for i in b] for b in layout.buckets]
    return [p.detach().clone() for p in model.parameters()], combiner.early, buckets


def ef(env: DistEnv, out: Path) -> None:
    runs = {}
    for name, kwargs in (
        ("overlap", dict(compressor="topk", ratio=0.1, bucket_mb=0.02)),
        ("plain", dict(compressor="topk", ratio=0.1, bucket_mb=0.02, overlap=False)),
        ("fp16_buckets", dict(compressor="fp16", bucket_mb=0.02)),
        ("fp16_whole", dict(compressor="fp16")),
    ):
        combiner = RecordingEF(seed=1, **kwargs)
        params, early, buckets = run(env, overlap=True, combiner=combiner)
        runs[name] = {"params": params, "early": early, "buckets": buckets, "log": combiner.log}
    # 3 steps, a checkpoint, and 3 more in a new process group member: the layout comes back
    # (rank 0's recorded order is not the first guess here: the side branch comes last)
    kwargs = dict(compressor="topk", ratio=0.1, bucket_mb=0.02, seed=1)
    path = out / "ef_resume.pt"
    run(env, True, RecordingEF(**kwargs), steps=STEPS // 2, save=path)
    resumed, early, _ = run(env, True, RecordingEF(**kwargs), resume=path)
    runs["resumed"] = {"params": resumed, "early": early}
    torch.save(runs, out / f"rank{env.rank}.pt")


def main(out: Path, mode: str = "adasum") -> None:
    torch.set_num_threads(1)
    with DistEnv.from_env(device="cpu") as env:
        if mode == "ef":
            return ef(env, out)
        overlapped, early, buckets = run(env, overlap=True)
        plain, plain_early, _ = run(env, overlap=False)
        path = out / "adasum_resume.pt"
        run(env, True, steps=STEPS // 2, save=path)
        resumed, resumed_early, _ = run(env, True, resume=path)
        torch.save(
            {"overlap": overlapped, "plain": plain, "early": early, "plain_early": plain_early,
             "buckets": buckets, "resumed": resumed, "resumed_early": resumed_early},
            out / f"rank{env.rank}.pt",
        )  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
