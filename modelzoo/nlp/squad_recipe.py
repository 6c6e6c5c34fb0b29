"""The set-up of SQuAD fine-tuning, for ``scripts/finetune_squad.py`` and any other caller.

The recipes' defaults (:data:`BUILTIN_DEFAULTS`, :data:`SQUAD_DEFAULTS`, filled in by
:func:`squad_defaults`) and which data set the options name (:func:`resolve_squad_dataset`);
a recipe's options as one config (:class:`SquadRecipe`: its checks, data, model, vocabulary,
windows, task and exported artifact); which data (:func:`load_squad_sets`: the built-in
standard-library set, SQuAD's official files fetched by name through the store, or your own
files), which model (:func:`build_qa_model`: zoo weights, a pretrained checkpoint, or a
fine-tuned one), which vocabulary (:func:`build_qa_tokenizer`), the windows the model reads
(:func:`squad_windows`), the lines that report a finished run (:func:`held_out_report`), the
exported artifact (:func:`save_qa_artifact`) and a run log's trivial level
(:func:`untrained_f1_level`). Options are explicit arguments or typed
fields, not a script's namespace; nothing here imports ``trainers`` (a trainer checkpoint is
read by the ``load_state`` the caller passes).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import registry
from ..artifact import save_artifact
from ..convert.bert import load_bert_checkpoint
from ..store import ChecksumError, DownloadError
from .bert import BertForQuestionAnswering, bert_from_checkpoint, set_dropout
from .squad import SquadFeature, SquadSet, make_features, read_squad, squad_file
from .squad_task import EvalExamples, SquadTask
from .stdlib_squad import stdlib_squad
from .tokenizer import BertTokenizer, get_tokenizer

__all__ = [
    "BUILTIN_DEFAULTS",
    "DATASETS",
    "NAMED_VERSIONS",
    "PREDICTION_OPTIONS",
    "SQUAD_DEFAULTS",
    "MissingVocabularyError",
    "SquadFetchError",
    "SquadOptionError",
    "SquadRecipe",
    "build_qa_model",
    "build_qa_tokenizer",
    "held_out_report",
    "load_squad_sets",
    "untrained_f1_level",
    "resolve_squad_dataset",
    "save_qa_artifact",
    "squad_defaults",
    "squad_windows",
]

#: SQuAD's official data sets by name, and their versions.
NAMED_VERSIONS = {"squad1.1": "1.1", "squad2.0": "2.0"}
#: The windowing and post-processing options an exported QA model was evaluated with.
PREDICTION_OPTIONS = ("max_seq_length", "doc_stride", "max_query_length", "max_answer_length",
                      "n_best_size", "version_2", "null_score_diff_threshold")  # fmt: skip

#: ``--dataset`` names: the built-in set, and SQuAD's official files by version.
DATASETS = ("stdlib", *NAMED_VERSIONS)
# What a newcomer gets with no data flags: MiniLM on the built-in stdlib set, CPU-sized.
BUILTIN_DEFAULTS = dict(
    bert_model="minilm_l6_h384",
    max_seq_length=128,
    doc_stride=64,
    max_query_length=32,
    batch_size=16,
    test_batch_size=32,
    epochs=2,
    lr=1e-4,
    log_interval=5,
)
#: GluonNLP's SQuAD recipe: the defaults with SQuAD's files (by name or your own).
SQUAD_DEFAULTS = dict(
    bert_model="bert_12_768_12",
    max_seq_length=384,
    doc_stride=128,
    max_query_length=64,
    batch_size=12,
    test_batch_size=24,
    epochs=2,
    lr=3e-5,
    log_interval=50,
)

PathLike = str | os.PathLike[str]


class SquadFetchError(RuntimeError):
    """An official SQuAD file could not be fetched (no network, offline, or wrong bytes).

    Attributes:
        split: ``"train"`` or ``"dev"``.
        cause: the store's error, whose message names the file, its URL and where to put it.
    """

    def __init__(self, split: str, cause: Exception) -> None:
        super().__init__(f"{split}: {cause}")
        self.split = split
        self.cause = cause


class MissingVocabularyError(FileNotFoundError):
    """A checkpoint has no ``vocab.txt`` beside it and no vocabulary was given."""


class SquadOptionError(ValueError):
    """A recipe's options cannot run: the message names the flag (``finetune_squad.py``'s
    spelling) and what to do instead."""


def resolve_squad_dataset(
    dataset: str | None,
    *,
    train_file: PathLike | None = None,
    predict_file: PathLike | None = None,
    version_2: bool = False,
    gluonnlp_flag: str | None = None,
) -> tuple[str, str, bool]:
    """The data set the options name, what chose it, and whether it is SQuAD 2.0.

    Args:
        dataset: ``--dataset`` (``stdlib`` or a name of :data:`NAMED_VERSIONS`), or ``None``.
        train_file, predict_file: your own SQuAD-format files (``dataset`` ``files``).
        version_2: ``--version-2``; without a ``dataset`` or files it names ``squad2.0``.
        gluonnlp_flag: a flag only GluonNLP's commands give (its ``--gpu``): without a
            ``dataset`` or files, the command gets GluonNLP's data set, SQuAD v1.1.

    Returns:
        ``(dataset, chosen_by, version_2)``: ``stdlib``, ``squad1.1``, ``squad2.0`` or
        ``files``; the flag (or reason) that chose it; SQuAD 2.0 or not.

    Raises:
        SquadOptionError: The options contradict each other.
    """
    files = train_file is not None or predict_file is not None
    named, by = dataset, "--dataset"
    if named == "stdlib" and (files or version_2):
        raise SquadOptionError(
            "--dataset stdlib is the built-in SQuAD 1.1-format set; drop --train-file, "
            "--predict-file and --version-2, or name --dataset squad1.1 / squad2.0"
        )
    if named is None and not files:
        if version_2:
            named, by = "squad2.0", "--version-2"
        elif gluonnlp_flag:
            named, by = "squad1.1", f"{gluonnlp_flag}: a GluonNLP command, GluonNLP's data set"
        else:
            named, by = "stdlib", "no data flags"
    if named == "squad1.1" and version_2:
        raise SquadOptionError(
            "--dataset squad1.1 and --version-2 contradict: SQuAD 2.0 is --dataset squad2.0"
        )
    if named == "squad2.0":
        version_2 = True
    return named or "files", by if named else "--train-file/--predict-file", version_2


def squad_defaults(dataset: str, options: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The recipe's defaults for the options (flag values by name, ``None``: not given) that
    ``options`` leave unset: :data:`BUILTIN_DEFAULTS` for the built-in set (``dataset``
    ``stdlib``), else :data:`SQUAD_DEFAULTS`; and a note when the default model is the large
    download of SQuAD's files (``None`` otherwise)."""
    builtin = dataset == "stdlib"
    defaults = BUILTIN_DEFAULTS if builtin else SQUAD_DEFAULTS
    values = {key: value for key, value in defaults.items() if options.get(key) is None}
    note = None
    if "bert_model" in values and not builtin:  # a 440 MB download: say which and why
        note = (f"note: --bert-model {values['bert_model']}, the default with SQuAD's files "
                f"(the built-in set's is {BUILTIN_DEFAULTS['bert_model']})")  # fmt: skip
    return values, note


@dataclass(frozen=True)
class SquadRecipe:
    """A SQuAD fine-tuning recipe's data, model and prediction options, as
    ``finetune_squad.py``'s flags of the same names (defaults: GluonNLP's SQuAD recipe,
    :data:`SQUAD_DEFAULTS`, on the built-in set).

    ``dataset`` is ``stdlib``, a name of :data:`NAMED_VERSIONS` or ``files`` (your
    ``train_file``/``predict_file``), chosen by ``dataset_by`` (:func:`resolve_squad_dataset`).
    """

    dataset: str = "stdlib"
    dataset_by: str = ""
    data_dir: PathLike | None = None
    train_file: PathLike | None = None
    predict_file: PathLike | None = None
    version_2: bool = False
    skip_bad_examples: bool = False
    only_predict: bool = False
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64
    bert_model: str = "bert_12_768_12"
    dropout: float | None = None
    bert_weights: str | None = None
    pretrained_bert_parameters: PathLike | None = None
    model_parameters: PathLike | None = None
    vocab_file: PathLike | None = None
    unpad: bool = False
    n_best_size: int = 20
    max_answer_length: int = 30
    null_score_diff_threshold: float = 0.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SquadRecipe:
        """The recipe of ``options`` (e.g. a script's flags, ``vars(args)``): its fields by
        name; the other entries are not the recipe's."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in options.items() if key in names})

    def check_options(
        self,
        *,
        tensor_parallel: int | None = None,
        pipeline_parallel: int | None = None,
        plan: str | None = None,
    ) -> None:
        """What the options must satisfy together (only the parameters files are looked for).

        Args:
            tensor_parallel, pipeline_parallel, plan: how the model is split over ranks
                (``--tensor-parallel``, ``--pipeline-parallel``, ``--plan``), if it is.

        Raises:
            SquadOptionError: the first option that does not fit, named as its flag.
        """
        builtin, named = self.dataset == "stdlib", self.dataset in NAMED_VERSIONS
        if self.max_seq_length <= self.max_query_length + 3:
            raise SquadOptionError(
                f"--max-seq-length ({self.max_seq_length}) must be greater than "
                f"--max-query-length ({self.max_query_length}) + 3"
            )
        if self.only_predict and not (builtin or named) and self.predict_file is None:
            raise SquadOptionError(
                "--only-predict needs --predict-file (or --dataset squad1.1/squad2.0)"
            )
        if not self.only_predict and not (builtin or named) and self.train_file is None:
            raise SquadOptionError("training needs --train-file or --dataset squad1.1/squad2.0 "
                                   "(or --only-predict)")  # fmt: skip
        for flag, value in (("--pretrained-bert-parameters", self.pretrained_bert_parameters),
                            ("--model-parameters", self.model_parameters)):  # fmt: skip
            if value and not Path(value).exists():
                raise SquadOptionError(f"{flag} {value}: no such file or directory")
        split = [flag for flag, on in (("--tensor-parallel", tensor_parallel not in (None, 1)),
                                       ("--pipeline-parallel", pipeline_parallel not in (None, 1)),
                                       ("--plan", bool(plan))) if on]  # fmt: skip
        if self.unpad and split:
            raise SquadOptionError(
                f"--unpad does not run on a model split by {split[0]}; drop one of the two"
            )

    def check_inputs(self) -> None:
        """What the options name exists, before any work: ``bert_model`` is a zoo BERT, the
        ``train_file``/``predict_file`` the run reads are files.

        Raises:
            SquadOptionError: naming the flag and what to do.
        """
        read = [("--predict-file", self.predict_file)]
        read += [] if self.only_predict else [("--train-file", self.train_file)]
        for flag, value in read:
            if value and not Path(value).is_file():
                raise SquadOptionError(
                    f"{flag} {value}: no such file (give a SQuAD-format .json file, or "
                    "--dataset squad1.1/squad2.0 to fetch the official ones)"
                )
        try:
            modality = registry.model_modality(self.bert_model)
        except ValueError as err:
            raise SquadOptionError(f"--bert-model {self.bert_model}: {err}") from None
        if modality != "text":
            berts = ", ".join(registry.list_models(modality="text"))
            raise SquadOptionError(
                f"--bert-model {self.bert_model} is not a BERT; choose one of {berts}"
            )

    def load_sets(
        self, *, progress: bool = True, say: Callable[[str], Any] | None = None
    ) -> tuple[SquadSet | None, SquadSet | None]:
        """The training and evaluation sets (:func:`load_squad_sets`).

        Raises:
            SquadOptionError: A named file cannot be fetched (the store's message names the
                file, its URL and where to put it).
            SquadFormatError: A file is not SQuAD-format (and ``skip_bad_examples`` is off).
        """
        try:
            return load_squad_sets(
                self.dataset, train_file=self.train_file, predict_file=self.predict_file,
                version_2=self.version_2, only_predict=self.only_predict,
                skip_bad=self.skip_bad_examples, data_dir=self.data_dir, progress=progress,
                chosen_by=self.dataset_by, say=say,
            )  # fmt: skip
        except SquadFetchError as exc:
            raise SquadOptionError(
                f"{self.dataset} ({self.dataset_by}) needs its {exc.split} file: {exc.cause} "
                "Without the network, --dataset stdlib trains on the built-in set."
            ) from None

    def build_model(
        self,
        *,
        progress: bool = True,
        load_state: Callable[[Path], Mapping[str, Any]] | None = None,
        say: Callable[[str], Any] | None = None,
        gradient_checkpointing: bool = False,
    ) -> BertForQuestionAnswering:
        """The BERT with a span head (:func:`build_qa_model`), with ``dropout`` when given,
        its layers recomputed in the backward with ``gradient_checkpointing`` and run on the
        real tokens only with ``unpad``.

        Raises:
            SquadOptionError: ``bert_model`` builds no BERT.
        """
        model = build_qa_model(
            self.bert_model, pretrained_parameters=self.pretrained_bert_parameters,
            fine_tuned_parameters=self.model_parameters, weights=self.bert_weights,
            progress=progress, load_state=load_state, say=say,
        )  # fmt: skip
        if not isinstance(model, BertForQuestionAnswering):
            raise SquadOptionError(f"--bert-model {self.bert_model} is not a BERT")
        if self.dropout is not None:
            set_dropout(model, self.dropout)
        model.bert.set_gradient_checkpointing(gradient_checkpointing)
        model.bert.set_unpadding(self.unpad)
        return model

    def build_tokenizer(self, *, progress: bool = True) -> BertTokenizer:
        """``vocab_file``; else the vocabulary saved beside ``model_parameters`` or
        ``pretrained_bert_parameters``; else the one published with the zoo weights
        (:func:`build_qa_tokenizer`).

        Raises:
            SquadOptionError: ``pretrained_bert_parameters`` has no ``vocab.txt`` beside it.
        """
        try:
            return build_qa_tokenizer(
                self.bert_model, vocab_file=self.vocab_file,
                fine_tuned_parameters=self.model_parameters,
                pretrained_parameters=self.pretrained_bert_parameters, weights=self.bert_weights,
                progress=progress,
            )  # fmt: skip
        except MissingVocabularyError:
            raise SquadOptionError(
                f"--pretrained-bert-parameters {self.pretrained_bert_parameters}: no vocab.txt "
                "beside it; pass the checkpoint's vocabulary with --vocab-file"
            ) from None

    def windows(
        self,
        train_set: SquadSet | None,
        dev_set: SquadSet | None,
        tokenizer: BertTokenizer,
        *,
        say: Callable[[str], Any] | None = None,
    ) -> tuple[list[SquadFeature] | None, EvalExamples | None]:
        """The training windows and the evaluation set (:func:`squad_windows`)."""
        return squad_windows(
            train_set, dev_set, tokenizer, max_seq_length=self.max_seq_length,
            doc_stride=self.doc_stride, max_query_length=self.max_query_length, say=say,
        )  # fmt: skip

    def task(self, dev_set: SquadSet | None) -> SquadTask:
        """The loss and the official metrics over ``dev_set``'s questions (none without one)."""
        return SquadTask(
            dev_set.examples if dev_set is not None else [], n_best_size=self.n_best_size,
            max_answer_length=self.max_answer_length, version_2=self.version_2,
            null_score_diff_threshold=self.null_score_diff_threshold,
        )  # fmt: skip

    def export(
        self,
        directory: PathLike,
        model: torch.nn.Module,
        tokenizer: BertTokenizer,
        *,
        metrics: Mapping[str, Any],
        source: Mapping[str, Any],
        state_dict: Mapping[str, Any] | None = None,
    ) -> Path:
        """The artifact folder of the fine-tuned ``model`` (or of ``state_dict``'s weights,
        e.g. an EMA's) with the recipe's windowing and post-processing
        (:func:`save_qa_artifact`)."""
        return save_qa_artifact(
            directory, model, tokenizer, model_name=self.bert_model,
            options=dataclasses.asdict(self), metrics=metrics, source=source,
            state_dict=state_dict,
        )  # fmt: skip


def held_out_report(
    train_set: SquadSet | None,
    dev_set: SquadSet | None,
    metrics: Mapping[str, Any],
    *,
    questions: int,
    seconds: float,
    ema_metrics: Mapping[str, Any] | None = None,
    ema_dir: PathLike | None = None,
) -> list[str]:
    """The lines that end a run: the malformed questions each set skipped, the held-out F1 of
    ``metrics`` (the last evaluation, of ``questions`` questions, after ``seconds``; nothing
    without one) and of the EMA's ``ema_metrics`` (its files in ``ema_dir``)."""
    lines = [f"[{name}] {data.report()}"
             for name, data in (("train", train_set), ("dev", dev_set))
             if data is not None and data.skipped]  # fmt: skip
    if metrics:
        f1 = metrics.get("f1", math.nan)
        lines.append(f"Held-out F1 {f1:.2f} ({questions} questions, {seconds:.1f} s)")
    if ema_metrics is not None and "ema_f1" in ema_metrics:
        lines.append(f"Held-out F1 of the EMA {ema_metrics['ema_f1']:.2f} ({ema_dir})")
    return lines


def load_squad_sets(
    dataset: str,
    *,
    train_file: PathLike | None = None,
    predict_file: PathLike | None = None,
    version_2: bool = False,
    only_predict: bool = False,
    skip_bad: bool = False,
    data_dir: PathLike | None = None,
    progress: bool = True,
    chosen_by: str = "",
    say: Callable[[str], Any] | None = None,
) -> tuple[SquadSet | None, SquadSet | None]:
    """The training and evaluation sets, saying in one line (``say``) which data.

    Args:
        dataset: ``stdlib`` (the built-in set), a name of :data:`NAMED_VERSIONS` (the official
            files, fetched and verified into ``data_dir`` when missing), or ``files``.
        train_file, predict_file: your own SQuAD-format files; they replace the named ones.
        version_2: read SQuAD 2.0 (unanswerable questions).
        only_predict: no training set (``None`` in its place).
        skip_bad: skip malformed questions (counted) instead of raising.
        data_dir: the folder of the named files (default: the store's).
        progress: show download progress.
        chosen_by: what chose the data, for the line ``say`` gets.

    Raises:
        SquadFetchError: A named file cannot be fetched.
        SquadFormatError: A file is not SQuAD-format (and ``skip_bad`` is off).
    """
    say = say or (lambda line: None)
    version = "2.0" if version_2 else "1.1"
    if dataset == "stdlib":
        say(
            "data: the built-in SQuAD 1.1-format set of Python standard-library docstrings "
            "(modelzoo.nlp.stdlib_squad, nothing downloaded); --dataset squad1.1 or squad2.0 "
            "fetches SQuAD"
        )
        train = None if only_predict else read_squad(stdlib_squad("train"), training=True)
        return train, read_squad(stdlib_squad("dev"))
    own = {"train": train_file, "dev": predict_file}
    paths: dict[str, tuple[str, bool]] = {}  # split -> (path, official)
    for split in ("dev",) if only_predict else ("train", "dev"):
        if own[split]:
            paths[split] = (str(own[split]), False)
        elif dataset in NAMED_VERSIONS:
            try:
                path = squad_file(NAMED_VERSIONS[dataset], split, root=data_dir, progress=progress)
            except (DownloadError, ChecksumError, FileNotFoundError) as exc:
                raise SquadFetchError(split, exc) from None
            paths[split] = (str(path), True)
    named = dataset in NAMED_VERSIONS
    what = f"SQuAD v{version} by name" if named else f"SQuAD {version}-format files"
    listed = ", ".join(
        f"{split} {path}" + (" (official, sha256-verified)" if official else " (yours)")
        for split, (path, official) in paths.items()
    )
    say(f"data: {what} ({chosen_by}): {listed}")
    read = {
        split: read_squad(path, version=version, skip_bad=skip_bad, training=split == "train")
        for split, (path, _) in paths.items()
    }
    return read.get("train"), read.get("dev")


def squad_windows(
    train_set: SquadSet | None,
    dev_set: SquadSet | None,
    tokenizer: BertTokenizer,
    *,
    max_seq_length: int,
    doc_stride: int,
    max_query_length: int,
    say: Callable[[str], Any] | None = None,
) -> tuple[list[SquadFeature] | None, EvalExamples | None]:
    """The training windows and the evaluation set (whole questions with their windows) of
    the sets given (``None`` for a set not given), saying how many windows each has."""
    say = say or (lambda line: None)
    window = dict(
        max_seq_length=max_seq_length, doc_stride=doc_stride, max_query_length=max_query_length
    )
    train_features = None
    if train_set is not None:
        train_features = make_features(train_set.examples, tokenizer, training=True, **window)
        say(f"[train] {len(train_features)} windows of {len(train_set)} questions")
    eval_set = None
    if dev_set is not None:
        dev_features = make_features(dev_set.examples, tokenizer, **window)
        eval_set = EvalExamples(dev_set.examples, dev_features)
        say(f"[dev] {len(dev_features)} windows of {len(dev_set)} questions")
    return train_features, eval_set


def build_qa_model(
    model_name: str,
    *,
    pretrained_parameters: PathLike | None = None,
    fine_tuned_parameters: PathLike | None = None,
    weights: str | None = None,
    progress: bool = True,
    load_state: Callable[[Path], Mapping[str, Any]] | None = None,
    say: Callable[[str], Any] | None = None,
) -> torch.nn.Module:
    """A BERT with a span (question-answering) head, in this order of sources:

    ``pretrained_parameters`` with a ``config.json`` beside it builds that checkpoint's size;
    otherwise zoo model ``model_name`` is built, with the weights of ``pretrained_parameters``
    (a Hugging Face directory or file, or a GluonNLP ``.params`` file), or its published
    weights ``weights`` (default: its first tag) when neither parameters file is given. Then
    ``fine_tuned_parameters`` are loaded: a Hugging Face directory or ``.safetensors`` file, or
    any other checkpoint through ``load_state`` (default ``torch.load(weights_only=True)``;
    its ``"model"`` entry when it has one).
    """
    say = say or (lambda line: None)
    entry = registry.get_model_entry(model_name)
    source = Path(pretrained_parameters or "")
    folder = source if source.is_dir() else source.parent
    if pretrained_parameters and (folder / "config.json").is_file():
        # A checkpoint with its config (e.g. scripts/pretrain_bert.py's): build its size.
        model = bert_from_checkpoint(source, head="qa")
        say(f"loaded {source} ({model.config.num_layers} layers, from its config.json)")
    elif pretrained_parameters or fine_tuned_parameters:
        model = entry.builder(head="qa")
        if pretrained_parameters:
            load_bert_checkpoint(model, pretrained_parameters)
            say(f"loaded {pretrained_parameters}")
    else:
        model = registry.get_model(model_name, pretrained=weights or True, head="qa",
                                   progress=progress)  # fmt: skip
    if fine_tuned_parameters:
        path = Path(fine_tuned_parameters)
        if path.is_dir() or path.suffix == ".safetensors":
            load_bert_checkpoint(model, path)  # a Hugging Face directory, or ours
        else:
            load = load_state or (lambda p: torch.load(p, map_location="cpu", weights_only=True))
            state = load(path)  # e.g. a trainer checkpoint
            model.load_state_dict(state.get("model", state), strict=True)
        say(f"loaded fine-tuned parameters {path}")
    return model


def build_qa_tokenizer(
    model_name: str,
    *,
    vocab_file: PathLike | None = None,
    fine_tuned_parameters: PathLike | None = None,
    pretrained_parameters: PathLike | None = None,
    weights: str | None = None,
    progress: bool = True,
) -> BertTokenizer:
    """``vocab_file``; else the vocabulary saved beside ``fine_tuned_parameters`` or
    ``pretrained_parameters``; else the one published with zoo model ``model_name``'s weights.

    Raises:
        MissingVocabularyError: ``pretrained_parameters`` (not a GluonNLP ``.params`` file,
            whose vocabulary is the published one) has no ``vocab.txt`` beside it.
    """
    if vocab_file:
        return BertTokenizer.from_file(vocab_file)
    for source in (fine_tuned_parameters, pretrained_parameters):
        if not source:
            continue
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
        if (folder / "vocab.txt").is_file():
            return BertTokenizer.from_dir(folder)
    source = pretrained_parameters
    if source and Path(source).suffix != ".params":
        raise MissingVocabularyError(f"{source}: no vocab.txt beside it")
    return get_tokenizer(model_name, weights or True, progress=progress)


def save_qa_artifact(
    directory: PathLike,
    model: torch.nn.Module,
    tokenizer: BertTokenizer,
    *,
    model_name: str,
    options: Mapping[str, Any],
    metrics: Mapping[str, Any],
    source: Mapping[str, Any],
    state_dict: Mapping[str, Any] | None = None,
) -> Path:
    """The artifact folder of a fine-tuned QA model: the model (or ``state_dict``'s weights,
    e.g. an EMA's), its vocabulary, and the :data:`PREDICTION_OPTIONS` of ``options`` it was
    evaluated with; ``modelzoo.pipeline('question-answering', directory)`` loads it."""
    return save_artifact(
        directory, model, model_name=model_name, model_kwargs={"head": "qa"},
        task="question-answering", preprocessing={key: options[key] for key in PREDICTION_OPTIONS},
        tokenizer=tokenizer, metrics=dict(metrics), source=dict(source), state_dict=state_dict,
    )  # fmt: skip


def untrained_f1_level(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The trivial level of a fine-tuning run log's claims: the F1 of the untrained QA head on
    the run's own evaluation set, which ``--eval-at-start`` measures before the first step
    (the log's step-0 evaluation record).

    Raises:
        SquadOptionError: The log has no step-0 evaluation with an F1.
    """
    start = [r for r in records if r.get("kind") == "eval" and r.get("step") == 0]
    if not start or start[0].get("f1") is None:
        raise SquadOptionError(
            "the log has no step-0 evaluation: publish SQuAD recipes with --eval-at-start "
            "(the untrained QA head's F1 is the task's trivial level)"
        )
    return {"value": float(start[0]["f1"]), "how": "the untrained QA head's F1 (step 0)"}
