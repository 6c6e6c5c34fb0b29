"""Raw text -> sharded, memory-mapped BERT pretraining instances (masked LM + next sentence).

Google's ``create_pretraining_data.py`` with its flag names, streaming (corpora larger than
memory work; see :mod:`modelzoo.nlp.pretraining` for the rules and the shard format):

    python scripts/prepare_bert_data.py --input-file corpus/*.txt --output-dir data/phase1 \\
        --max-seq-length 128 --max-predictions-per-seq 20 --dupe-factor 5
    python scripts/prepare_bert_data.py --input-file corpus/*.txt --output-dir data/phase2 \\
        --max-seq-length 512 --max-predictions-per-seq 80 --dupe-factor 5

Input: UTF-8 text, one sentence per line, a blank line between documents. The vocabulary is
``--vocab-file`` (a BERT ``vocab.txt``) or the one published with ``--bert-model``'s weights
(default: the uncased English vocabulary of ``minilm_l6_h384``, offline). ``--stdlib-corpus
DIR`` first writes a corpus of the running Python's standard-library docstrings
(``DIR/train.txt`` or ``DIR/dev.txt``, different modules) for ``--stdlib-split``. Prepare one
directory per phase (sequence length) and per split; the vocabulary is saved beside the shards.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from modelzoo.nlp.pretraining import InstanceConfig, prepare_pretraining_data, write_stdlib_corpus
from modelzoo.nlp.tokenizer import BertTokenizer, get_tokenizer
from modelzoo.registry import get_model_entry
from modelzoo.store import ChecksumError, DownloadError
from trainers.cli import ArgumentParser, Bound, brief, print_config, run_main
from trainers.errors import UsageError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description="Make BERT pretraining shards (masked LM + next sentence) from raw text.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--input-file", nargs="*", default=[], help="corpus text files")
    p.add_argument(
        "--stdlib-corpus",
        type=str,
        default=None,
        metavar="DIR",
        help="write the stdlib-docstring corpus into DIR and use it as the input",
    )
    p.add_argument("--stdlib-split", choices=("train", "dev"), default="train")
    p.add_argument("--output-dir", type=str, required=True, help="shard directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output-dir")
    p.add_argument("--vocab-file", type=str, default=None, help="BERT vocab.txt")
    p.add_argument("--do-lower-case", type=int, default=1, choices=(0, 1))
    p.add_argument("--bert-model", type=str, default="minilm_l6_h384", help="vocabulary source")
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--max-predictions-per-seq", type=int, default=20)
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--random-next-prob", type=float, default=0.5)
    p.add_argument("--whole-word-mask", action="store_true", help="mask whole words")
    p.add_argument("--dupe-factor", type=int, default=1, help="passes with different masks")
    p.add_argument(
        "--window-docs",
        type=int,
        default=256,
        help="documents held in memory (the random-next pool)",
    )
    p.add_argument("--instances-per-shard", type=int, default=65536)
    p.add_argument("--random-seed", type=int, default=12345)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    brief(p, *(a.option_strings[-1] for a in p._actions if a.option_strings))
    args = p.parse_args(argv)
    if not args.input_file and args.stdlib_corpus is None:
        p.error("give --input-file FILE [FILE ...] or --stdlib-corpus DIR")
    p.check(args, bounds=BOUNDS)
    try:
        instance_config(args)
    except ValueError as err:
        p.error(str(err))
    return p.finish(args)


BOUNDS = {
    "max_seq_length": Bound(1), "max_predictions_per_seq": Bound(1),
    "masked_lm_prob": Bound(0, 1), "short_seq_prob": Bound(0, 1), "random_next_prob": Bound(0, 1),
    "dupe_factor": Bound(1), "window_docs": Bound(1), "instances_per_shard": Bound(1),
    "random_seed": Bound(0),
}  # fmt: skip
# InstanceConfig's field -> the flag that sets it (its errors name the field).
FLAGS = {"max_seq_length": "--max-seq-length", "max_predictions_per_seq":
         "--max-predictions-per-seq", "masked_lm_prob": "--masked-lm-prob", "short_seq_prob":
         "--short-seq-prob", "random_next_prob": "--random-next-prob", "whole_word_mask":
         "--whole-word-mask", "dupe_factor": "--dupe-factor", "window_docs": "--window-docs",
         "seed": "--random-seed"}  # fmt: skip


def instance_config(args: argparse.Namespace) -> InstanceConfig:
    try:
        return InstanceConfig(
            max_seq_length=args.max_seq_length,
            max_predictions_per_seq=args.max_predictions_per_seq,
            masked_lm_prob=args.masked_lm_prob,
            short_seq_prob=args.short_seq_prob,
            random_next_prob=args.random_next_prob,
            whole_word_mask=args.whole_word_mask,
            dupe_factor=args.dupe_factor,
            window_docs=args.window_docs,
            seed=args.random_seed,
        )
    except ValueError as exc:
        message = str(exc)
        for field, flag in FLAGS.items():
            message = re.sub(rf"\b{field}\b", flag, message)
        raise ValueError(message) from None


def check_args(args: argparse.Namespace) -> None:
    """What the flags name -- input files, the vocabulary -- exists, before any work.

    Raises:
        UsageError: naming the flag and what to do.
    """
    for path in args.input_file:
        if not Path(path).is_file():
            raise UsageError(f"--input-file {path}: no such file")
    if args.vocab_file is not None and not Path(args.vocab_file).is_file():
        raise UsageError(f"--vocab-file {args.vocab_file}: no such file")
    if args.vocab_file is None:
        try:
            get_model_entry(args.bert_model)
        except ValueError as err:
            raise UsageError(f"--bert-model {args.bert_model}: {err}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    if print_config(args):
        return 0
    config = instance_config(args)
    inputs = [Path(p) for p in args.input_file]
    if args.stdlib_corpus is not None:
        corpus = Path(args.stdlib_corpus) / f"{args.stdlib_split}.txt"
        stats = write_stdlib_corpus(corpus, args.stdlib_split)
        print(f"wrote {corpus}: {stats}")
        inputs.append(corpus)
    if args.vocab_file:
        tokenizer = BertTokenizer.from_file(args.vocab_file, lowercase=bool(args.do_lower_case))
    else:
        tokenizer = get_tokenizer(args.bert_model, progress=not args.no_progress)
    start = time.perf_counter()
    try:
        index = prepare_pretraining_data(
            inputs,
            args.output_dir,
            tokenizer,
            config,
            instances_per_shard=args.instances_per_shard,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise SystemExit(f"prepare_bert_data.py: error: {exc}") from None
    totals = index["totals"]
    print(
        f"wrote {args.output_dir}: {totals['instances']} instances in {len(index['shards'])} "
        f"shards, {totals['tokens']} tokens, {totals['masked']} masked, "
        f"{totals['random_next'] / max(1, totals['instances']):.3f} random next "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, expected=(DownloadError, ChecksumError)))
