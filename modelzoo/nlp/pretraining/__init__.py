"""BERT pretraining data: raw text -> sharded, memory-mapped masked-LM + next-sentence instances.

The instance rules are Google's ``create_pretraining_data.py`` (Devlin et al. 2019,
https://github.com/google-research/bert), made streaming so that corpora larger than memory
work:

* **Input**: one sentence per line, a blank line between documents (Google's format).
* **Pairs**: each document is cut into chunks of about ``target_seq_length`` tokens
  (``max_seq_length - 3``; with probability ``short_seq_prob`` a random shorter target), each
  chunk split at a random sentence boundary into segment A and B. With probability
  ``random_next_prob`` (0.5) B is replaced by sentences from a *different* document (label 1,
  "random next"), and the chunk's unused sentences are put back; otherwise B is the real
  continuation (label 0). The pair is trimmed, longer side first, from a random end.
* **Masked LM**: ``min(max_predictions_per_seq, max(1, round(len(tokens) * masked_lm_prob)))``
  positions are chosen among the non-special tokens (never ``[CLS]``/``[SEP]``); of those 80 %
  become ``[MASK]``, 10 % a random vocabulary token and 10 % stay unchanged. With
  ``whole_word_mask`` a word's ``##`` pieces are chosen together.

Two deliberate differences from Google's script:

* Google forces a random next whenever a chunk holds a single sentence, so its share of
  random-next pairs is above one half. Here the coin is tossed for every pair; a
  single-sentence chunk whose coin says "actual next" is split inside the sentence at a
  random token (B is still the text that follows A), so the share is exactly
  ``random_next_prob`` in expectation. Chunks of fewer than 2 tokens are skipped.
* Google reads every document into memory to draw random-next documents from the whole
  corpus, then shuffles all instances. Here documents stream through a window of
  ``window_docs`` documents (the one being cut sits in the middle, up to ``window_docs // 2``
  read ahead): random-next sentences come from another document of that window, so memory
  is bounded by the window and by one shard of instances, whatever the corpus size. The
  instances are written in corpus order; the training sampler shuffles them globally (the
  shards are memory-mapped, so random access costs nothing).

Shard format (``SHARD_FORMAT``): a directory with ``index.json`` and ``shard-NNNNN.npy`` files,
each a structured numpy array (fields in :func:`shard_dtype`) read with
``np.load(mmap_mode="r")``. The index holds the format version, the settings, the vocabulary
size and hash, and every shard's name, instance count and byte size. A run builds the whole
directory under a temporary name and renames it into place at the end, so a failure never
leaves partial shards behind.

The stdlib corpus (:func:`write_stdlib_corpus`): real English text available offline, the
docstrings of the running interpreter's standard library, read with :mod:`ast` (no module
is imported, so nothing runs), one document per module, split into sentences; modules are
divided into train and dev by a hash of their name.

Example:
    >>> write_stdlib_corpus("corpus/train.txt", split="train")  # doctest: +SKIP
    >>> tok = get_tokenizer("minilm_l6_h384")  # doctest: +SKIP
    >>> prepare_pretraining_data(["corpus/train.txt"], "data/p1", tok,
    ...                          InstanceConfig(max_seq_length=128))  # doctest: +SKIP
    >>> data = PretrainingShards("data/p1")  # doctest: +SKIP
"""

from .corpus import corpus_vocabulary, stdlib_documents, write_stdlib_corpus
from .instances import (
    INDEX_NAME,
    SHARD_FORMAT,
    InstanceConfig,
    ShardError,
    TrainingInstance,
    VocabInfo,
    create_instances,
    mask_tokens,
    read_documents,
)
from .shards import (
    PretrainingCollate,
    PretrainingShards,
    prepare_pretraining_data,
    shard_dtype,
    write_shards,
)

__all__ = [
    "INDEX_NAME",
    "SHARD_FORMAT",
    "InstanceConfig",
    "PretrainingCollate",
    "PretrainingShards",
    "ShardError",
    "TrainingInstance",
    "VocabInfo",
    "create_instances",
    "mask_tokens",
    "prepare_pretraining_data",
    "read_documents",
    "shard_dtype",
    "corpus_vocabulary",
    "stdlib_documents",
    "write_shards",
    "write_stdlib_corpus",
]
