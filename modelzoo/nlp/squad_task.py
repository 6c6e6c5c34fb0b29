"""SQuAD fine-tuning as a task: the data sets, the batches, the loss and the evaluation.

What ``scripts/finetune_squad.py`` trains with (GluonNLP's ``finetune_squad.py``, rebuilt):
training windows (:class:`TrainFeatures`), evaluation by whole questions
(:class:`EvalExamples`) so that every rank post-processes and scores the questions it holds,
the padding collate (:class:`Collate`), the span loss and the official metrics per question
(:class:`SquadTask`), and a trainer hook that writes the prediction files after every
evaluation (:class:`PredictionFiles`). The trainer is duck-typed: nothing here imports
``trainers``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .squad import (
    SquadExample,
    SquadFeature,
    pad_features,
    postprocess,
    score_example,
    squad_v1_metrics,
    squad_v2_metrics,
    write_predictions,
)

__all__ = [
    "Collate",
    "EvalExamples",
    "EvalItem",
    "PredictionFiles",
    "SquadTask",
    "TrainFeatures",
    "pipeline_inputs",
]


class TrainFeatures(Dataset):
    """Training windows: each item is one :class:`SquadFeature`."""

    def __init__(self, features: Sequence[SquadFeature]) -> None:
        self.features = list(features)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> SquadFeature:
        return self.features[index]


@dataclass
class EvalItem:
    """One question with all its windows: evaluation works on whole questions, so every
    rank can post-process and score the questions it holds."""

    example_index: int
    features: list[SquadFeature]


class EvalExamples(Dataset):
    def __init__(self, examples: Sequence[SquadExample], features: Sequence[SquadFeature]):
        self.examples = list(examples)
        self.by_example: list[list[SquadFeature]] = [[] for _ in self.examples]
        for feature in features:
            self.by_example[feature.example_index].append(feature)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> EvalItem:
        return EvalItem(index, self.by_example[index])


class Collate:
    """Pads training windows (with start/end labels) or evaluation questions' windows."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        if isinstance(items[0], EvalItem):
            features = [f for item in items for f in item.features]
            batch: dict[str, Any] = pad_features(features, self.pad_id)
            batch["example_index"] = [item.example_index for item in items]
            batch["num_features"] = [len(item.features) for item in items]
            batch["features"] = features
            return batch
        batch = pad_features(items, self.pad_id)
        batch["start_positions"] = torch.tensor([f.start_position for f in items])
        batch["end_positions"] = torch.tensor([f.end_position for f in items])
        return batch


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------


def pipeline_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The QA model's inputs for ``--pipeline-parallel``: the attention mask as integers, all
    ones where no window of the batch is padded (the stages pass a tensor on)."""
    ids = batch["input_ids"]
    mask = batch["attention_mask"]
    if mask is None:
        return ids, batch["token_type_ids"], torch.ones_like(ids)
    return ids, batch["token_type_ids"], mask.long()


class SquadTask:
    """Loss, evaluation (post-processing + the official metric per question) and the
    prediction files."""

    def __init__(
        self,
        examples: Sequence[SquadExample],
        *,
        n_best_size: int = 20,
        max_answer_length: int = 30,
        version_2: bool = False,
        null_score_diff_threshold: float = 0.0,
    ) -> None:
        self.n_best_size = n_best_size
        self.max_answer_length = max_answer_length
        self.version_2 = version_2
        self.null_score_diff_threshold = null_score_diff_threshold
        self.examples = list(examples)
        self.predictions: dict[str, str] = {}
        self.nbest: dict[str, Any] = {}
        self.null_odds: dict[str, float] = {}

    def train_step(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict]:
        logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        start = F.cross_entropy(logits.start.float(), batch["start_positions"])
        end = F.cross_entropy(logits.end.float(), batch["end_positions"])
        return (start + end) / 2, {}

    def eval_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        starts = logits.start.float().cpu().numpy()
        ends = logits.end.float().cpu().numpy()
        em = f1 = 0.0
        row = 0
        for index, count in zip(batch["example_index"], batch["num_features"], strict=True):
            example = self.examples[index]
            rows = slice(row, row + count)
            row += count
            text, nbest, null_odds = postprocess(
                example,
                batch["features"][rows],
                list(starts[rows]),
                list(ends[rows]),
                n_best_size=self.n_best_size,
                max_answer_length=self.max_answer_length,
                version_2=self.version_2,
                null_score_diff_threshold=self.null_score_diff_threshold,
            )
            self.predictions[example.qid] = text
            self.nbest[example.qid] = nbest
            if null_odds is not None:
                self.null_odds[example.qid] = null_odds
            e, f = score_example(example, text, version_2=self.version_2)
            em += e
            f1 += f
        em_key = "exact" if self.version_2 else "exact_match"
        return {em_key: 100.0 * em, "f1": 100.0 * f1, "count": len(batch["example_index"])}

    def finish_eval(self, env: Any, logger: Any, output_dir: Path) -> dict[str, float]:
        """Gathers every rank's predictions (``env``: a ``trainers.DistEnv``); rank 0 writes
        the files and the official scores and logs them (``logger.info``)."""
        parts = env.all_gather_object((self.predictions, self.nbest, self.null_odds))
        self.predictions, self.nbest, self.null_odds = {}, {}, {}
        if not env.is_main:
            return {}
        predictions = {q: t for part in parts for q, t in part[0].items()}
        nbest = {q: n for part in parts for q, n in part[1].items()}
        null_odds = {q: o for part in parts for q, o in part[2].items()}
        paths = write_predictions(
            output_dir, predictions, nbest, null_odds if self.version_2 else None
        )
        if self.version_2:
            scores = squad_v2_metrics(self.examples, predictions, null_odds)
        else:
            scores = squad_v1_metrics(self.examples, predictions)
        (output_dir / "eval_results.json").write_text(json.dumps(scores, indent=2) + "\n")
        logger.info(f"{scores}")
        logger.info(f"wrote {', '.join(str(p) for p in paths.values())}")
        return scores


class PredictionFiles:
    """Trainer hook: after every evaluation, write the predictions and official scores."""

    def __init__(self, task: SquadTask, env: Any, logger: Any, output_dir: Path) -> None:
        self.task, self.env, self.logger, self.output_dir = task, env, logger, output_dir

    def on_eval_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        self.task.finish_eval(self.env, self.logger, self.output_dir)
