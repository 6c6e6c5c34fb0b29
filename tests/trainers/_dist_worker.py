"""One rank of the 2-process tests in test_trainer_dist.py (run with torchrun's variables set).

Usage: python -m tests.trainers._dist_worker OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.trainers._trainer_toys import ToyDataset, eval_step, lr_fn, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig


class Wrapped(torch.nn.Module):
    """make_mlp's model in a module of its own: torch.compile of DDP captures the forward of
    a user's module, not that of a bare ``nn.Sequential`` (every frame torch's own)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build(env, config, logger=None, wrap=False):
    model = Wrapped(make_mlp(seed=0)) if wrap else make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9, weight_decay=1e-3)
    return Trainer(
        model,
        opt,
        config,
        env=env,
        logger=logger or RunLogger(None, enabled=False),
        lr_schedule=lr_fn,
        train_step=train_step,
        eval_step=eval_step,
    )


def main(out: Path) -> None:
    with DistEnv.from_env(device="cpu") as env:
        assert env.world_size == 2 and env.backend == "gloo"
        results = {}

        # Plain data parallel: 2 epochs, global batch 8, evaluation on an uneven split.
        logger = RunLogger(out / f"log_rank{env.rank}.jsonl", enabled=env.is_main, console=False)
        cfg = TrainerConfig(
            epochs=2, batch_size=4, seed=5, log_interval=2, save_dir=str(out / "ckpt")
        )
        trainer = build(env, cfg, logger)
        trainer.fit(ToyDataset(48), eval_dataset=ToyDataset(11))
        logger.close()
        results["ddp"] = [p.detach().clone() for p in trainer.model.parameters()]
        results["eval"] = trainer.last_eval

        # Accumulation: count DDP all-reduces through a communication hook.
        cfg = TrainerConfig(epochs=2, batch_size=2, grad_accum_steps=4, seed=6, log_interval=0)
        trainer = build(env, cfg)
        calls = {"n": 0}

        def counting_hook(state, bucket):
            state["n"] += 1
            return default_hooks.allreduce_hook(None, bucket)

        trainer.forward_model.register_comm_hook(calls, counting_hook)
        trainer.fit(ToyDataset(32))
        results["accum"] = [p.detach().clone() for p in trainer.model.parameters()]
        results["accum_steps"] = trainer.global_step
        results["allreduce_calls"] = calls["n"]

        # Compiled (torch.compile of the DDP wrapper), with accumulation: DDP's no_sync and
        # its bucket all-reduce through the compiled module.
        cfg = TrainerConfig(epochs=2, batch_size=2, grad_accum_steps=2, seed=6, log_interval=0,
                            compile="on")  # fmt: skip
        trainer = build(env, cfg, wrap=True)
        compiled_calls = {"n": 0}
        trainer.forward_model.register_comm_hook(compiled_calls, counting_hook)
        trainer.fit(ToyDataset(32))
        results["compiled"] = [p.detach().clone() for p in trainer.model.parameters()]
        results["compiled_allreduce_calls"] = compiled_calls["n"]
        results["compiled_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        torch.save(results, out / f"rank{env.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
