"""The model-family protocol (:mod:`modelzoo.family`): every registered model has a family,
and a new family is its own class: export, backbones and pipeline parallelism reach it
without naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import modelzoo
from modelzoo import family as family_module
from modelzoo.entries import get_model_entry
from modelzoo.export import example_inputs, export_program
from modelzoo.family import (
    FamilyError,
    ModelFamily,
    family_of,
    find_family,
    get_modality,
    list_families,
    register_family,
)


@pytest.fixture
def scratch_families(monkeypatch):
    """Families registered in a test never leak into the real list."""
    monkeypatch.setattr(family_module, "_FAMILIES", list(family_module._FAMILIES))


class _Toy(nn.Module):
    """A model of no zoo family: two linear maps over ``(B, in_features)`` rows."""

    def __init__(self, in_features: int = 6) -> None:
        super().__init__()
        self.in_features = in_features
        self.a = nn.Linear(in_features, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _ToyFamily(ModelFamily):
    name = "toy"
    model_classes = (_Toy,)
    modality = "tabular"
    classifiers = (_Toy,)

    def example_inputs(self, model: nn.Module, *, batch_size: int,
                       generator: torch.Generator, **sizes: Any) -> tuple[Any, ...]:  # fmt: skip
        return (torch.randn(batch_size, model.in_features, generator=generator),)

    def inputs_like(self, model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
        return {"batch_size": inputs[0].shape[0] + 1}

    def pipeline_blocks(self, model: nn.Module) -> list[nn.Module]:
        return [nn.Sequential(model.a, nn.ReLU()), model.b]


@pytest.mark.parametrize("name", modelzoo.list_models())
def test_every_registered_model_has_a_family(name):
    with torch.device("meta"):
        model = get_model_entry(name).builder()
    family = find_family(model)
    assert family is not None, f"{name}: {type(model).__qualname__} has no family"
    assert isinstance(model, family.model_classes)


def test_the_known_families():
    import modelzoo.linear  # noqa: F401  (registers the linear family)

    names = {f.name for f in list_families()}
    assert {"ResNeSt", "BERT", "node classifiers", "GIN", "linear"} <= names


def test_a_model_of_no_family_is_refused_with_the_families_named():
    with pytest.raises(FamilyError, match=r"_Toy is of no registered model family \(known: .*BERT"):
        family_of(_Toy())
    with pytest.raises(ValueError, match=r"no default inputs for _Toy \(it is of no registered"):
        example_inputs(_Toy())


def test_a_new_family_is_its_class_only(scratch_families, tmp_path):
    register_family(_ToyFamily())
    model = _Toy()
    assert family_of(model).name == "toy"
    assert family_of(type("Sub", (_Toy,), {})).name == "toy"  # subclasses belong to it
    # export asks the family for inputs and exports with a dynamic batch
    x = example_inputs(model, batch_size=3)
    assert x[0].shape == (3, 6)
    path = export_program(model, x, tmp_path / "toy.pt2")
    loaded = torch.export.load(path).module()
    other = torch.randn(5, 6)
    torch.testing.assert_close(loaded(other), model(other), rtol=0, atol=0)
    # pipeline parallelism takes its block chain
    from trainers.parallel.pipeline import model_blocks

    blocks = model_blocks(model)
    out = other
    for block in blocks:
        out = block(out)
    torch.testing.assert_close(out, model(other), rtol=0, atol=0)
    # what it does not answer is refused with its name
    with pytest.raises(FamilyError, match="the toy family does not support it"):
        family_of(model).tensor_parallel_layers(model)
    with pytest.raises(ValueError, match="_Toy is not a backbone model"):
        modelzoo.create_features(model)


def test_register_family_refuses_bad_families(scratch_families):
    with pytest.raises(ValueError, match="needs a name and model_classes"):
        register_family(ModelFamily())
    register_family(_ToyFamily())
    with pytest.raises(ValueError, match="a family named 'toy' is registered"):
        register_family(_ToyFamily())

    class Again(_ToyFamily):
        name = "again"

    with pytest.raises(ValueError, match="_Toy already belongs to the 'toy' family"):
        register_family(Again())

    class Odd(_ToyFamily):
        name, modality = "odd", "smell"

    with pytest.raises(ValueError, match="modality must be one of"):
        register_family(Odd())


def test_linear_models_export_with_a_dynamic_batch(tmp_path):
    from modelzoo.linear import LogisticRegression, MultinomialLogisticRegression

    for model in (LogisticRegression(5), MultinomialLogisticRegression(5, 3)):
        with torch.no_grad():
            model.weight.normal_()
        path = export_program(model, example_inputs(model), tmp_path / "glm.pt2")
        x = torch.randn(9, 5)
        torch.testing.assert_close(torch.export.load(path).module()(x), model(x))


def test_weights_preprocessing_comes_from_the_modality():
    """The image weights' transform is the evaluation transform of their numbers, built by
    the image modality (oracle: eval_transforms called directly)."""
    from PIL import Image

    from modelzoo.vision.transforms import eval_transforms

    weights = modelzoo.get_weights("resnest50")
    image = Image.fromarray(
        torch.randint(
            0, 256, (300, 260, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        ).numpy()
    )
    expected = eval_transforms(
        weights.input_size,
        crop_ratio=weights.crop_ratio,
        mean=tuple(255 * m for m in weights.mean),
        std=tuple(255 * s for s in weights.std),
    )(image)
    torch.testing.assert_close(weights.transforms()(image), expected, rtol=0, atol=0)
    assert get_modality("image").required_options == ("input_size", "crop_ratio", "mean", "std")
    with pytest.raises(ValueError, match="modality 'smell' is not registered"):
        get_modality("smell")
    with pytest.raises(ValueError, match="text inputs are preprocessed by their tokenizer"):
        modelzoo.get_weights("minilm_l6_h384").transforms()


def test_list_models_by_modality_follows_the_families():
    """Every registered model reads what its family says: the ResNeSts and ResNets images,
    the BERTs text, the GNNs graphs (the names by hand; none is left without a family)."""
    names = modelzoo.list_models()
    image = {n for n in names if n.startswith(("resnest", "resnet"))}
    text = {n for n in names if n.startswith(("bert_", "minilm"))}
    graph = {n for n in names if n.startswith(("gcn", "gat", "gin", "graphsage"))}
    assert image | text | graph == set(names)
    assert set(modelzoo.list_models(modality="image")) == image
    assert set(modelzoo.list_models(modality="text")) == text
    assert set(modelzoo.list_models(modality="graph")) == graph
    assert modelzoo.list_models("resnet5*", modality="image") == ["resnet50_v1b", "resnet50_v1d"]
    assert modelzoo.registry.model_modality("minilm_l6_h384") == "text"
    with pytest.raises(ValueError, match="resnest50"):
        modelzoo.registry.model_modality("resnest5")
