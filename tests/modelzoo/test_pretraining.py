"""BERT pretraining data: masking statistics, next-sentence pairs, shards, HF export.

Oracles: the published rates (15 % of the tokens; 80/10/10) with binomial tolerances,
explicit construction rules (special tokens never masked, whole words masked together, random
next never from the same document, actual next is the text that follows), the instances
given to the shard writer, and ``transformers.BertForPreTraining`` for the exported model.
"""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest
import torch

from modelzoo.nlp.pretraining import (
    InstanceConfig,
    PretrainingCollate,
    PretrainingShards,
    ShardError,
    TrainingInstance,
    VocabInfo,
    create_instances,
    mask_tokens,
    prepare_pretraining_data,
    read_documents,
    write_shards,
)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N_WORDS = 3000
# Words w0..; every third id after them a "##" piece.
TOKENS = SPECIALS + [f"w{i}" for i in range(N_WORDS)] + [f"##p{i}" for i in range(N_WORDS)]
VOCAB = VocabInfo.from_tokens(TOKENS)
WORD0 = len(SPECIALS)
PIECE0 = WORD0 + N_WORDS


def _sigma_bound(p: float, n: int, sigmas: float = 5.0) -> float:
    return sigmas * math.sqrt(p * (1 - p) / n)


def _sequence(rng: random.Random, length: int, pieces: bool = False) -> list[int]:
    body = []
    for _ in range(length):
        if pieces and body and rng.random() < 0.4:
            body.append(PIECE0 + rng.randrange(N_WORDS))
        else:
            body.append(WORD0 + rng.randrange(N_WORDS))
    cut = rng.randint(1, length - 1)
    return [VOCAB.cls_id, *body[:cut], VOCAB.sep_id, *body[cut:], VOCAB.sep_id]


def test_masking_rates_and_rules():
    rng = random.Random(0)
    counts = {"mask": 0, "kept": 0, "random": 0}
    total_masked = total_tokens = 0
    for _ in range(3000):
        tokens = _sequence(rng, rng.randint(10, 120))
        out, positions, labels = mask_tokens(tokens, VOCAB, rng, max_predictions=20)
        # the count rule of Google's create_masked_lm_predictions
        assert len(positions) == min(20, max(1, round(len(tokens) * 0.15)))
        assert positions == sorted(set(positions))
        assert all(tokens[p] not in (VOCAB.cls_id, VOCAB.sep_id) for p in positions)
        assert labels == [tokens[p] for p in positions]
        untouched = set(range(len(tokens))) - set(positions)
        assert all(out[i] == tokens[i] for i in untouched)
        for p in positions:
            if out[p] == VOCAB.mask_id:
                counts["mask"] += 1
            elif out[p] == tokens[p]:
                counts["kept"] += 1
            else:
                counts["random"] += 1
        total_masked += len(positions)
        total_tokens += len(tokens) - 3
    n = total_masked
    # A random replacement equal to the original counts as kept: probability 0.1 / V.
    expected = {"mask": 0.8, "kept": 0.1 + 0.1 / VOCAB.size, "random": 0.1 * (1 - 1 / VOCAB.size)}
    for kind, p in expected.items():
        assert abs(counts[kind] / n - p) <= _sigma_bound(p, n), (kind, counts[kind] / n)
    # 15 % of all tokens (specials included in the count, as Google's rule does), capped at 20
    assert 0.13 <= total_masked / (total_tokens + 3 * 3000) <= 0.16


def test_random_replacements_are_uniform_over_the_vocabulary():
    rng = random.Random(1)
    draws = []
    for _ in range(4000):
        tokens = _sequence(rng, 60)
        out, positions, _ = mask_tokens(tokens, VOCAB, rng)
        draws += [out[p] for p in positions if out[p] not in (VOCAB.mask_id, tokens[p])]
    draws = np.array(draws)
    # the share drawn from the lower half of the ids is one half
    p = (VOCAB.size // 2) / VOCAB.size
    assert abs((draws < VOCAB.size // 2).mean() - p) <= _sigma_bound(p, len(draws))


def test_whole_word_masking_masks_whole_words_only():
    rng = random.Random(2)
    partial_words = 0
    for _ in range(1000):
        tokens = _sequence(rng, 80, pieces=True)
        out, positions, _ = mask_tokens(tokens, VOCAB, rng, whole_word=True, max_predictions=20)
        chosen = set(positions)
        assert len(positions) <= min(20, max(1, round(len(tokens) * 0.15)))
        words, i = [], 0
        while i < len(tokens):  # a word: a non-piece token and the pieces right after it
            j = i + 1
            special = tokens[i] in (VOCAB.cls_id, VOCAB.sep_id)
            while not special and j < len(tokens) and VOCAB.continuation[tokens[j]]:
                j += 1
            words.append(range(i, j))
            i = j
        for word in words:
            hit = [p in chosen for p in word]
            partial_words += any(hit) and not all(hit)
        assert all(tokens[p] not in (VOCAB.cls_id, VOCAB.sep_id) for p in positions)
    assert partial_words == 0


# ---- next-sentence pairs ---------------------------------------------------------------------
STRIDE = 400  # document d, sentence s, token j: id WORD0 + d * STRIDE + s * 20 + j


def _documents(num_docs: int, rng: random.Random) -> list[list[list[int]]]:
    docs = []
    for d in range(num_docs):
        sentences = rng.randint(1, 12)
        docs.append(
            [
                [WORD0 + d * STRIDE + s * 20 + j for j in range(rng.randint(1, 15))]
                for s in range(sentences)
            ]
        )
    return docs


def _unmasked(inst: TrainingInstance) -> list[int]:
    tokens = list(inst.input_ids)
    for p, t in zip(inst.masked_positions, inst.masked_ids, strict=True):
        tokens[p] = t
    return tokens


def _doc(token: int) -> int:
    return (token - WORD0) // STRIDE


def test_next_sentence_pairs_follow_the_construction_rules():
    vocab = VocabInfo.from_tokens(SPECIALS + [f"t{i}" for i in range(7 * STRIDE)])
    rng = random.Random(3)
    docs = _documents(6, rng)  # ids of doc 5 stay < 6 * STRIDE + WORD0
    config = InstanceConfig(max_seq_length=512, short_seq_prob=0.3, window_docs=4, seed=0)
    window = config.window_docs
    instances = []
    for _ in range(150):  # passes: many pairs from the same documents
        instances += list(create_instances(docs, vocab, config, rng))
    flat = {d: [t for s in doc for t in s] for d, doc in enumerate(docs)}
    random_next = 0
    for inst in instances:
        tokens = _unmasked(inst)
        assert tokens[0] == vocab.cls_id and tokens[-1] == vocab.sep_id
        assert tokens[inst.len_a + 1] == vocab.sep_id
        a, b = tokens[1 : inst.len_a + 1], tokens[inst.len_a + 2 : -1]
        assert a and b
        assert len({_doc(t) for t in a}) == 1 and len({_doc(t) for t in b}) == 1
        doc_a, doc_b = _doc(a[0]), _doc(b[0])
        if inst.is_random_next:
            random_next += 1
            assert doc_b != doc_a  # never from the same document
            assert abs(doc_b - doc_a) < window  # from the bounded window
        else:  # the actual continuation: A then B is a contiguous run of the document
            assert doc_b == doc_a
            text, run = flat[doc_a], a + b
            start = text.index(run[0])
            assert text[start : start + len(run)] == run
    n = len(instances)
    assert n > 1000
    assert abs(random_next / n - 0.5) <= _sigma_bound(0.5, n)


def test_pairs_are_trimmed_to_the_sequence_length():
    rng = random.Random(4)
    config = InstanceConfig(max_seq_length=24, max_predictions_per_seq=4, seed=0)
    for inst in create_instances(_documents(8, rng), VOCAB, config, rng):
        assert len(inst.input_ids) <= 24
        assert len(inst.masked_positions) <= 4


def test_one_document_is_an_error():
    with pytest.raises(ValueError, match="at least 2"):
        list(create_instances([[[10, 11, 12]]], VOCAB, InstanceConfig(), random.Random(0)))


def test_documents_stream_from_text(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("One.\nTwo.\n\n\nThree.\n\nFour.\nFive.\n")
    assert list(read_documents([path])) == [["One.", "Two."], ["Three."], ["Four.", "Five."]]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"bad\.txt:2: not UTF-8"):
        list(read_documents([bad]))


# ---- shards -------------------------------------------------------------------------------------
def _instances(n: int = 50, seed: int = 5) -> list[TrainingInstance]:
    rng = random.Random(seed)
    config = InstanceConfig(max_seq_length=32, max_predictions_per_seq=5, seed=seed)
    out = []
    while len(out) < n:
        out += list(create_instances(_documents(6, rng), VOCAB, config, rng))
    return out[:n]


def test_shards_round_trip(tmp_path):
    instances = _instances()
    config = InstanceConfig(max_seq_length=32, max_predictions_per_seq=5)
    index = write_shards(
        instances, tmp_path / "d", vocab=VOCAB, config=config, instances_per_shard=16
    )
    assert [s["instances"] for s in index["shards"]] == [16, 16, 16, 2]
    data = PretrainingShards(tmp_path / "d", vocab_sha256=VOCAB.sha256)
    assert len(data) == len(instances)
    for i, inst in enumerate(instances):
        assert data.instance(i) == inst
    batch = PretrainingCollate(VOCAB.pad_id)([data[i] for i in range(7)])
    width = max(len(inst.input_ids) for inst in instances[:7])
    assert batch["input_ids"].shape == (7, width)
    for row, inst in enumerate(instances[:7]):
        n = len(inst.input_ids)
        assert batch["input_ids"][row, :n].tolist() == inst.input_ids
        assert batch["token_type_ids"][row, :n].tolist() == inst.token_type_ids
        assert not batch["token_type_ids"][row, n:].any()
        k = len(inst.masked_positions)
        assert batch["masked_positions"][row, :k].tolist() == inst.masked_positions
        assert batch["masked_labels"][row, :k].tolist() == inst.masked_ids
        assert (batch["masked_labels"][row, k:] == -100).all()
        assert batch["next_sentence_labels"][row] == int(inst.is_random_next)
        if batch["attention_mask"] is not None:
            assert batch["attention_mask"][row].sum() == n


def test_bad_shards_name_the_file(tmp_path):
    config = InstanceConfig(max_seq_length=32, max_predictions_per_seq=5)
    write_shards(_instances(), tmp_path / "d", vocab=VOCAB, config=config, instances_per_shard=20)
    with pytest.raises(ShardError, match="another vocabulary"):
        PretrainingShards(tmp_path / "d", vocab_sha256="0" * 64)
    shard = tmp_path / "d" / "shard-00001.npy"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(ShardError, match=r"shard-00001\.npy.*truncated"):
        PretrainingShards(tmp_path / "d")
    index_path = tmp_path / "d" / "index.json"
    index = json.loads(index_path.read_text())
    index["format"] = 99
    index_path.write_text(json.dumps(index))
    with pytest.raises(ShardError, match="format 99"):
        PretrainingShards(tmp_path / "d")
    with pytest.raises(ShardError, match="no shard index"):
        PretrainingShards(tmp_path / "missing")


def test_a_failed_write_leaves_nothing(tmp_path):
    def broken():
        yield from _instances(30)
        raise RuntimeError("disk full")

    config = InstanceConfig(max_seq_length=32, max_predictions_per_seq=5)
    with pytest.raises(RuntimeError, match="disk full"):
        write_shards(broken(), tmp_path / "d", vocab=VOCAB, config=config, instances_per_shard=8)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("keep")
    with pytest.raises(FileExistsError, match="not empty"):
        write_shards(_instances(5), tmp_path / "d", vocab=VOCAB, config=config)


def test_prepare_from_text_is_deterministic(tmp_path):
    from modelzoo.nlp.tokenizer import BertTokenizer

    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "a", "."]
    tokenizer = BertTokenizer({t: i for i, t in enumerate(SPECIALS + words + ["##s"])})
    rng = random.Random(6)
    lines = []
    for _ in range(40):
        lines += [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(5)]
        lines.append("")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(lines))
    config = InstanceConfig(max_seq_length=24, max_predictions_per_seq=4, dupe_factor=2, seed=1)
    for name in ("a", "b"):
        prepare_pretraining_data([corpus], tmp_path / name, tokenizer, config, progress=False)
    a, b = PretrainingShards(tmp_path / "a"), PretrainingShards(tmp_path / "b")
    assert len(a) == len(b) > 100
    assert all(a.instance(i) == b.instance(i) for i in range(len(a)))
    # every unmasked B segment's words are words of the corpus
    known = {tokenizer.vocab[w] for w in words}
    for i in range(len(a)):
        tokens = _unmasked(a.instance(i))
        assert set(tokens) - {tokenizer.cls_id, tokenizer.sep_id} <= known


# ---- the recipe (modelzoo/nlp/pretraining/recipe.py) ---------------------------------------------
def test_recipe_vocabulary_comes_from_the_first_source_that_has_one(tmp_path):
    from modelzoo.nlp.pretraining.recipe import recipe_tokenizer, vocab_sha256

    sources = {}
    for name, extra in (("file", "fileword"), ("p1", "oneword"), ("p2", "twoword"),
                        ("model", "modelword")):  # fmt: skip
        (tmp_path / name).mkdir()
        sources[name] = tmp_path / name
        (sources[name] / "vocab.txt").write_text("\n".join([*SPECIALS, extra]) + "\n")

    def last(**kwargs):
        tok = recipe_tokenizer(**kwargs)
        return None if tok is None else tok.convert_ids_to_tokens([len(tok) - 1])[0]

    dirs = [None, sources["p2"]]
    assert last(vocab_file=sources["file"] / "vocab.txt", data_dirs=dirs) == "fileword"
    assert (
        last(data_dirs=[sources["p1"], sources["p2"]], phase1_model=sources["model"]) == "oneword"
    )
    assert last(data_dirs=dirs, phase1_model=sources["model"]) == "twoword"
    assert last(data_dirs=[tmp_path / "none"], phase1_model=sources["model"]) == "modelword"
    assert last(data_dirs=[tmp_path / "none"], phase1_model=tmp_path / "none") is None
    # the hash a shard index records for the vocabulary: shards of it open, others refuse it
    tok = recipe_tokenizer(vocab_file=sources["file"] / "vocab.txt")
    words = ["fileword"] * 9
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join("\n".join(" ".join(words) for _ in range(3)) for _ in range(6)))
    config = InstanceConfig(max_seq_length=16, max_predictions_per_seq=3, seed=1)
    prepare_pretraining_data([corpus], tmp_path / "s", tok, config, progress=False)
    assert len(PretrainingShards(tmp_path / "s", vocab_sha256=vocab_sha256(tok))) > 0
    other = recipe_tokenizer(vocab_file=sources["model"] / "vocab.txt")
    with pytest.raises(ShardError, match="another vocabulary"):
        PretrainingShards(tmp_path / "s", vocab_sha256=vocab_sha256(other))


def test_masked_lm_labels_are_the_masked_tokens_written(tmp_path):
    from modelzoo.nlp.pretraining.recipe import masked_lm_labels

    instances = _instances(40)
    config = InstanceConfig(max_seq_length=32, max_predictions_per_seq=5)
    write_shards(instances, tmp_path / "d", vocab=VOCAB, config=config, instances_per_shard=16)
    expected = [token for inst in instances for token in inst.masked_ids]
    assert masked_lm_labels(PretrainingShards(tmp_path / "d")) == expected


def test_schedule_shape_rounds_gluonnlp_keeps_fractions_nvidia_has_no_constant_phase():
    from modelzoo.nlp.pretraining.recipe import schedule_shape

    ratios = dict(warmup_ratio=0.05, const_ratio=0.25)
    assert schedule_shape("warmup_const_poly", 782, **ratios) == (
        "warmup_const_poly",
        {"warmup_steps": 39, "constant_steps": 196},
    )  # 39.1, 195.5
    assert schedule_shape("gluonnlp", 782, **ratios) == (
        "warmup_const_poly",
        {"warmup_ratio": 0.05, "constant_ratio": 0.25},
    )
    assert schedule_shape("nvidia_poly_warmup", 782, warmup_ratio=0.1, const_ratio=0.0) == (
        "nvidia_poly_warmup", {"warmup_ratio": 0.1})  # fmt: skip


def test_new_pretraining_bert_is_the_same_for_the_same_seed():
    from modelzoo.nlp.pretraining.recipe import new_pretraining_bert

    shape = dict(num_layers=1, hidden_size=16, num_heads=2, intermediate_size=32,
                 max_position_embeddings=40, dropout=0.0, initializer_range=0.5)  # fmt: skip
    a, b = (new_pretraining_bert(50, seed=3, **shape) for _ in range(2))
    c = new_pretraining_bert(50, seed=4, **shape)
    assert (a.config.vocab_size, a.config.hidden_size, a.config.num_layers) == (50, 16, 1)
    assert (a.config.max_position_embeddings, a.config.initializer_range) == (40, 0.5)
    weights = a.state_dict()
    assert all(torch.equal(t, b.state_dict()[k]) for k, t in weights.items())
    assert not torch.equal(weights["mlm.dense.weight"], c.state_dict()["mlm.dense.weight"])


# ---- the phases (modelzoo/nlp/pretraining/phases.py) ---------------------------------------------
def _phases(changes=None):
    """Phases 1 and 2 with the defaults, but for ``changes`` (phase -> settings)."""
    from modelzoo.nlp.pretraining.phases import PHASE_DEFAULTS, Phase

    return [Phase(n, **{**PHASE_DEFAULTS[n], **(changes or {}).get(n, {})}) for n in (1, 2)]


def test_plan_phases_fills_the_defaults_and_names_the_flag_it_refuses():
    from modelzoo.nlp.pretraining.phases import PhaseConfigError, plan_phases

    plan = plan_phases("2,1", _phases({2: {"lr": 0.01}}), data={}, optimizer="lamb")
    assert (plan.order, plan.lr, plan.const_ratio, plan.decay_power) == ([1, 2], 5e-3, 0.25, 1.0)
    assert (plan.phases[1].lr, plan.phases[2].lr, plan.builtin) == (5e-3, 0.01, True)
    plan = plan_phases("1", _phases(), data={1: "shards"}, optimizer="adamw",
                       lr_schedule="nvidia_poly_warmup", max_position_embeddings=16)  # fmt: skip
    assert (plan.lr, plan.const_ratio, plan.decay_power, plan.builtin) == (1e-4, 0, 0.5, False)
    assert plan_phases("2", _phases(), data={}, optimizer="lans", resume=True).order == [2]
    refused = {
        "--phases must be 1, 2 or 1,2, got '3'": dict(phases="3"),
        "--phases must be 1, 2 or 1,2, got 'x'": dict(phases="x"),
        "--phases must be 1, 2 or 1,2, got ' , '": dict(phases=" , "),
        "--lr-schedule nvidia_poly_warmup has no constant phase: drop --const-ratio": dict(
            lr_schedule="nvidia_poly_warmup", const_ratio=0.25),
        "--decay-power must be positive, got 0.0": dict(decay_power=0.0),
        "--phase2-accumulate must be >= 1": dict(settings=_phases({2: {"accumulate": 0}})),
        "--phase1-warmup-ratio + --const-ratio must be in [0, 1]": dict(
            settings=_phases({1: {"warmup_ratio": 0.8}})),
        "--phase2-max-seq-length exceeds --max-position-embeddings 256": dict(
            max_position_embeddings=256),
        "--plan places one phase": dict(plan=True),
        "--phases 2 needs --phase1-model DIR": dict(phases="2"),
    }  # fmt: skip
    for message, changes in refused.items():
        kwargs = {"phases": "1,2", "settings": _phases(), "data": {}, "optimizer": "lans",
                  **changes}  # fmt: skip
        with pytest.raises(PhaseConfigError, match="^" + re.escape(message)):
            plan_phases(kwargs.pop("phases"), kwargs.pop("settings"), **kwargs)
    # shards named for the phase: their length is checked when they are opened, not here
    named = {1: "a", 2: "b"}
    assert not plan_phases("1,2", _phases(), data=named, optimizer="lans",
                           max_position_embeddings=8).builtin  # fmt: skip


def test_check_sources_names_the_missing_or_wrong_thing(tmp_path):
    from modelzoo.nlp.pretraining.phases import PhaseConfigError, check_sources

    check_sources(bert_model="bert_12_768_12", phase1_model=tmp_path)
    for kwargs, message in (
        ({"bert_model": "resnest14"}, "--bert-model resnest14 is not a BERT; choose one of "),
        ({"bert_model": "bert_x"}, r"--bert-model bert_x: Unknown model 'bert_x'; did you mean"),
        ({"phase1_model": tmp_path / "no"}, r"no such directory \(phase 1 saves"),
        ({"vocab_file": tmp_path / "v.txt"}, "--vocab-file .*v.txt: no such file"),
    ):
        with pytest.raises(PhaseConfigError, match=message):
            check_sources(**kwargs)


def test_phase_epochs_are_the_passes_of_whole_steps():
    from modelzoo.nlp.pretraining.phases import PhaseDataError, phase_epochs

    assert phase_epochs(1, 100, steps=7, global_batch=30) == 3  # 3 steps a pass
    assert phase_epochs(2, 100, steps=6, global_batch=30) == 2
    assert phase_epochs(1, 30, steps=1, global_batch=30) == 1
    with pytest.raises(PhaseDataError, match=r"^phase 2: 29 instances are fewer than one global "
                       r"batch of 30 \(batch x accumulate x workers\)$"):  # fmt: skip
        phase_epochs(2, 29, steps=1, global_batch=30)


def test_phase_shards_and_sources(tmp_path):
    from modelzoo.nlp.pretraining.phases import PhaseDataError, PhaseSources, open_phase_shards
    from modelzoo.nlp.pretraining.recipe import masked_lm_labels
    from modelzoo.nlp.tokenizer import BertTokenizer

    config = InstanceConfig(max_seq_length=32, max_predictions_per_seq=5)
    for name, seed in (("train", 5), ("dev", 6)):
        write_shards(_instances(40, seed), tmp_path / name, vocab=VOCAB, config=config)
    (tmp_path / "train" / "vocab.txt").write_text("\n".join(TOKENS) + "\n")
    tok = BertTokenizer({t: i for i, t in enumerate(TOKENS)})
    data = open_phase_shards({1: (tmp_path / "train", tmp_path / "dev")}, tok,
                             max_position_embeddings=32)  # fmt: skip
    assert [len(data[1][0]), len(data[1][1])] == [40, 40]
    refused = {
        "^--phase2_data is missing$": {1: (tmp_path / "nope", None), 2: (None, None)},
        "nope.*index.json.*prepare_bert_data": {1: (tmp_path / "nope", None)},
    }
    for message, dirs in refused.items():
        with pytest.raises(PhaseDataError, match=message):
            open_phase_shards(dirs, tok)
    with pytest.raises(PhaseDataError, match="has 32-token instances, more than --max-position-e"):
        open_phase_shards({1: (tmp_path / "train", None)}, tok, max_position_embeddings=31)
    other = BertTokenizer({t: i for i, t in enumerate(SPECIALS)})
    with pytest.raises(PhaseDataError, match="another vocabulary"):
        open_phase_shards({1: (tmp_path / "train", None)}, other)

    sources = PhaseSources([1], {1: (tmp_path / "train", None)}, {1: (32, 5), 2: (64, 10)})
    assert not sources.builtin and len(sources.tokenizer()) == len(TOKENS)
    assert list(sources.open(sources.tokenizer())) == [1]
    with pytest.raises(PhaseDataError, match=r"no held-out data \(--phase1-eval-data\)"):
        sources.heldout_labels(1)
    sources = PhaseSources([1], {1: (tmp_path / "train", tmp_path / "dev")}, {1: (32, 5)})
    labels, what, name = sources.heldout_labels(1)
    assert labels == masked_lm_labels(PretrainingShards(tmp_path / "dev"))
    assert what == f"masked tokens of --phase1-eval-data {tmp_path / 'dev'}"
    assert name(WORD0) == "'w0'"
    assert sources.heldout_labels(1)[0] is labels  # read once
    (tmp_path / "train" / "vocab.txt").unlink()
    with pytest.raises(PhaseDataError, match="no vocab.txt beside the shards; pass --vocab-file"):
        PhaseSources([1], {1: (tmp_path / "train", None)}, {}).tokenizer()
    assert PhaseSources([2], {1: (tmp_path / "train", None)}, {}).builtin  # phase 2 names none


def test_phase_chain_skips_finished_phases_limits_steps_and_hands_over(tmp_path):
    from modelzoo.convert.bert import save_hf_directory
    from modelzoo.nlp.bert import BertConfig, build_bert
    from modelzoo.nlp.pretraining.phases import PhaseChain, PhaseModelError
    from modelzoo.nlp.tokenizer import BertTokenizer

    phases = _phases({1: {"steps": 4}, 2: {"steps": 3}})
    chain = PhaseChain(tmp_path, max_steps=6)
    assert [chain.limit(4), chain.save_dir(2), chain.model_dir(1)] == [
        4, tmp_path / "phase2", tmp_path / "phase1" / "model"]  # fmt: skip
    with pytest.raises(PhaseModelError, match="^phase 2 starts from phase 1's model, but None "):
        chain.start_model(8)
    run = []
    for phase in chain.pending(phases):
        run.append((phase.number, chain.limit(phase.steps)))
        chain.end_phase(phase.number, chain.limit(phase.steps), saved=phase.number == 1)
    assert run == [(1, 4), (2, 2)] and chain.done == 6 and chain.previous == chain.model_dir(1)
    # max_steps ended phase 1: phase 2 does not start
    chain, run = PhaseChain(tmp_path, max_steps=3), []
    for phase in chain.pending(phases):
        run.append(phase.number)
        chain.end_phase(phase.number, 3, saved=False)
    assert run == [1] and chain.done == 3 and chain.previous is None
    # resumed: phase 1's model is saved, so it counts as done and phase 2 starts from it
    tokenizer = BertTokenizer({t: i for i, t in enumerate(SPECIALS + ["a", "b", "c"])})
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, num_heads=2,
                        intermediate_size=32, max_position_embeddings=16)  # fmt: skip
    save_hf_directory(build_bert(config, head="pretraining"), tokenizer, chain.model_dir(1))
    (tmp_path / "phase2").mkdir()
    (tmp_path / "phase2" / "latest.pt").write_bytes(b"")
    assert PhaseChain(tmp_path).checkpoint(2) is None  # not resuming
    chain = PhaseChain(tmp_path, resuming=True, max_steps=5)
    said = []
    assert [p.number for p in chain.pending(phases, info=said.append)] == [2]
    assert said == [f"[Phase 1] already finished: {tmp_path / 'phase1' / 'model'}"]
    assert (chain.done, chain.limit(3)) == (4, 1)
    assert chain.checkpoint(2) == tmp_path / "phase2" / "latest.pt"
    assert chain.start_model(len(tokenizer)).config.vocab_size == len(tokenizer)
    with pytest.raises(PhaseModelError, match="has a 8-token vocabulary, the data 9$"):
        chain.start_model(9)
    # phase 2 alone starts from --phase1-model
    alone = PhaseChain(tmp_path / "other", phase1_model=chain.model_dir(1))
    assert alone.start_model(len(tokenizer)).config.hidden_size == 16


def test_fit_phase_evaluates_the_start_and_the_end_once():
    from modelzoo.nlp.pretraining.task import EvalTracker, fit_phase

    class Trainer:  # what fit_phase asks of the trainer
        global_step, epoch = 0, 0

        def __init__(self, evaluates_last: bool) -> None:
            self.evaluates_last, self.calls = evaluates_last, []

        def evaluate(self, dev, collate, remember=False):
            self.calls.append(("evaluate", self.global_step, remember))
            return {"mlm_accuracy": 0.5}

        def fit(self, train, eval_dataset, collate_fn):
            self.calls.append(("fit",))
            self.global_step, self.epoch = 5, 1
            if self.evaluates_last:
                tracker.on_eval_end(self, {})

    class EMA:
        def evaluate_and_log(self, trainer):
            trainer.calls.append(("ema", trainer.global_step))

    for first, evaluates_last, dev, expected in (
        (True, False, "dev", [("evaluate", 0, False), ("fit",), ("evaluate", 5, True), ("ema", 5)]),
        (False, True, "dev", [("fit",)]),
        (True, False, None, [("fit",)]),
    ):
        trainer, tracker, logged = Trainer(evaluates_last), EvalTracker(), []

        def log_eval(*, epoch, step, logged=logged, **metrics):
            logged.append((epoch, step, metrics))

        fit_phase(trainer, "train", dev, list, tracker=tracker, log_eval=log_eval, first=first,
                  ema=EMA())  # fmt: skip
        assert trainer.calls == expected
        evaluated = [c[1] for c in expected if c[0] == "evaluate"]
        assert logged == [(step // 5, step, {"mlm_accuracy": 0.5}) for step in evaluated]


# ---- export ------------------------------------------------------------------------------------
def test_saved_model_is_a_hugging_face_bert(tmp_path):
    transformers = pytest.importorskip("transformers")
    from modelzoo.convert.bert import save_hf_directory as save_pretrained
    from modelzoo.nlp.bert import BertConfig, bert_from_checkpoint, build_bert
    from modelzoo.nlp.tokenizer import BertTokenizer

    tokenizer = BertTokenizer({t: i for i, t in enumerate(SPECIALS + ["a", "b", "c"])})
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_layers=2, num_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = build_bert(config, head="pretraining").eval()
    with torch.no_grad():  # non-trivial values everywhere (biases start at 0)
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    directory = save_pretrained(ours, tokenizer, tmp_path / "m")
    assert {p.name for p in directory.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "vocab.txt",
    }
    hf = transformers.BertForPreTraining.from_pretrained(directory).eval()
    ids = torch.randint(0, len(tokenizer), (3, 9))
    types = (torch.arange(9) >= 4).long().expand(3, -1)
    with torch.no_grad():
        mine = ours(ids, types)
        theirs = hf(input_ids=ids, token_type_ids=types)
    torch.testing.assert_close(mine.mlm_logits, theirs.prediction_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        mine.nsp_logits, theirs.seq_relationship_logits, rtol=1e-4, atol=1e-4
    )
    again = bert_from_checkpoint(directory, head="pretraining")
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0)


def test_saved_qa_model_is_a_hugging_face_bert_for_question_answering(tmp_path):
    """finetune_squad.py's writer: qa_outputs under transformers' names, read back exactly;
    written into an existing directory without touching its other files."""
    transformers = pytest.importorskip("transformers")
    from modelzoo.convert.bert import load_bert_checkpoint, save_hf_directory
    from modelzoo.nlp.bert import BertConfig, build_bert
    from modelzoo.nlp.tokenizer import BertTokenizer

    tokenizer = BertTokenizer({t: i for i, t in enumerate(SPECIALS + ["a", "b", "c"])})
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_layers=2, num_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = build_bert(config, head="qa").eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    out = tmp_path / "run"
    out.mkdir()
    (out / "predictions.json").write_text("{}")
    save_hf_directory(ours, tokenizer, out, replace=False)
    assert (out / "predictions.json").read_text() == "{}"
    hf = transformers.BertForQuestionAnswering.from_pretrained(out).eval()
    ids = torch.randint(0, len(tokenizer), (2, 9))
    types = (torch.arange(9) >= 4).long().expand(2, -1)
    with torch.no_grad():
        theirs = hf(input_ids=ids, token_type_ids=types)
        mine = ours(ids, types)
    start, end = (mine.start_logits, mine.end_logits) if hasattr(mine, "start_logits") else mine
    torch.testing.assert_close(start, theirs.start_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(end, theirs.end_logits, rtol=1e-4, atol=1e-4)
    again = load_bert_checkpoint(build_bert(config, head="qa"), out)
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0)
