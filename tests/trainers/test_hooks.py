"""trainers.hooks: early stopping keeps the best weights and stops after its patience;
StopAtTarget stops at the first evaluation reaching the target (time to accuracy)."""

from __future__ import annotations

import torch

from tests.trainers._trainer_toys import ToyDataset, eval_step, lr_fn, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.hooks import EarlyStopping, StopAtTarget


class _Fake:
    """The two things the hook uses of a trainer."""

    def __init__(self) -> None:
        self.epoch, self.stopped = 0, False
        self.logger = RunLogger(None, enabled=False)

    def request_stop(self) -> None:
        self.stopped = True


def test_keeps_the_best_and_stops_after_patience():
    model = torch.nn.Linear(2, 1)
    hook = EarlyStopping(
        model, score=lambda m: (m["acc"], -m["loss"]), patience=2, report={"best_acc": "acc"}
    )
    trainer = _Fake()
    sequence = [(0.5, 1.0), (0.7, 0.9), (0.7, 0.8), (0.6, 0.5), (0.7, 0.8)]
    for epoch, (acc, loss) in enumerate(sequence):
        trainer.epoch = epoch
        if epoch == 2:
            with torch.no_grad():
                model.weight.fill_(3.0)  # the weights of the best evaluation (epoch 2)
        hook.on_eval_end(trainer, {"acc": acc, "loss": loss})
        with torch.no_grad():
            model.weight.fill_(-1.0)
        assert trainer.stopped == (epoch == 4)  # epochs 3 and 4 are no better than epoch 2
    assert hook.final_metrics() == {"best_epoch": 2, "best_acc": 0.7}
    assert torch.all(hook.best_state["weight"] == 3.0)


def test_in_the_trainer_it_ends_fit_and_reports_the_best_in_the_end_record(tmp_path):
    log = tmp_path / "run.jsonl"
    logger = RunLogger(log, console=False)
    model = make_mlp()
    # A score that never improves after the first evaluation: stop after 2 more epochs.
    hook = EarlyStopping(model, score=lambda m: 0, patience=2, report={"best_top1": "top1"})
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerConfig(epochs=10, batch_size=8, log_interval=0),
        env=DistEnv(),
        logger=logger,
        lr_schedule=lr_fn,
        train_step=train_step,
        eval_step=eval_step,
        hooks=[hook],
    )
    final = trainer.fit(ToyDataset(40), eval_dataset=ToyDataset(10, seed=4))
    logger.close()
    assert trainer.epoch == 3 and trainer.global_step == 15  # epochs 0, 1, 2 then stop
    assert final["best_epoch"] == 0 and "best_top1" in final


def test_stop_at_target_stops_at_the_first_evaluation_reaching_it():
    trainer = _Fake()
    trainer.global_step = 0
    hook = StopAtTarget("top1", 0.9)
    hook.on_train_start(trainer)
    for epoch, top1 in enumerate([0.5, 0.89999, 0.9, 0.95]):
        trainer.epoch, trainer.global_step = epoch, 10 * (epoch + 1)
        hook.on_eval_end(trainer, {"top1": top1})
        assert trainer.stopped == (epoch >= 2)  # 0.9 reaches 0.9; 0.89999 does not
    final = hook.final_metrics()
    assert final["target_reached"] is True and final["target"] == 0.9
    assert final["target_step"] == 30 and final["target_epoch"] == 2  # the first, not the last
    assert final["time_to_target"] >= 0


def test_stop_at_target_not_reached_trains_to_the_end_and_says_so(tmp_path):
    log = tmp_path / "run.jsonl"
    logger = RunLogger(log, console=False)
    model = make_mlp()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerConfig(epochs=3, batch_size=8, log_interval=0),
        env=DistEnv(),
        logger=logger,
        lr_schedule=lr_fn,
        train_step=train_step,
        eval_step=eval_step,
        hooks=[StopAtTarget("top1", 1.01)],  # above any accuracy
    )
    final = trainer.fit(ToyDataset(40), eval_dataset=ToyDataset(10, seed=4))
    logger.close()
    assert trainer.epoch == 3 and final["target_reached"] is False
    assert "time_to_target" not in final


def test_stop_at_target_in_the_trainer_ends_fit_after_the_reaching_evaluation(tmp_path):
    logger = RunLogger(tmp_path / "run.jsonl", console=False)
    model = make_mlp()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerConfig(epochs=10, batch_size=8, log_interval=0),
        env=DistEnv(),
        logger=logger,
        lr_schedule=lr_fn,
        train_step=train_step,
        eval_step=eval_step,
        hooks=[StopAtTarget("top1", 0.0)],  # the first evaluation reaches it
    )
    final = trainer.fit(ToyDataset(40), eval_dataset=ToyDataset(10, seed=4))
    logger.close()
    assert trainer.epoch == 1 and trainer.global_step == 5  # one epoch of 40 / 8, then stop
    assert final["target_reached"] is True and final["target_step"] == 5
    assert final["time_to_target"] > 0
