"""One rank of the 2-process EMA test in test_ema.py (run with torchrun's variables set).

Usage: python -m tests.trainers._ema_worker OUTDIR

Data-parallel training of a BatchNorm model (its running statistics differ between the
ranks) with ``--model-ema``; rank 0 also keeps PyTorch's AveragedModel in lock-step. Each
rank saves its EMA, the oracle and the run log's last EMA evaluation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.trainers._trainer_toys import ToyDataset, eval_step, lr_fn, train_step
from tests.trainers.test_ema import _bn_mlp
from trainers import DistEnv, ModelEMA, RunLogger, Trainer, TrainerConfig


class Oracle:
    """PyTorch's EMA of this rank's weights and buffers, updated after every step."""

    def on_train_start(self, trainer):
        self.model = AveragedModel(
            trainer.model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True
        )

    def on_step_end(self, trainer, step):
        self.model.update_parameters(trainer.model)


def main(out: Path) -> None:
    with DistEnv.from_env(device="cpu") as env:
        assert env.world_size == 2
        model = _bn_mlp()
        val = ToyDataset(21, seed=9)
        oracle, ema = Oracle(), ModelEMA(model, decay=0.8, eval_dataset=val)
        log = out / "run.jsonl"
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9),
            TrainerConfig(epochs=2, batch_size=4, seed=5, log_interval=0),
            env=env,
            logger=RunLogger(log, enabled=env.is_main, console=False),
            lr_schedule=lr_fn,
            train_step=train_step,
            eval_step=eval_step,
            hooks=[oracle, ema],
        )
        trainer.fit(ToyDataset(48, noise=0.2), eval_dataset=val)
        trainer.logger.close()
        torch.save(
            {
                "ema": ema.state_dict_for_export(),
                "oracle": oracle.model.module.state_dict(),
                "model": trainer.model.state_dict(),
                "final": ema.final_metrics(),
            },
            out / f"rank{env.rank}.pt",
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
