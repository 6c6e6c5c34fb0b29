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
import sys
import time
from pathlib import Path

from modelzoo.nlp.pretraining import InstanceConfig, prepare_pretraining_data, write_stdlib_corpus
from modelzoo.nlp.tokenizer import BertTokenizer, get_tokenizer
from trainers.cli import ArgumentParser


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
    args = p.parse_args(argv)
    if not args.input_file and args.stdlib_corpus is None:
        p.error("give --input-file FILE [FILE ...] or --stdlib-corpus DIR")
    return args


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
        raise SystemExit(f"prepare_bert_data.py: error: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    sys.exit(main())
