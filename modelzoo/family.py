"""The model-family protocol: what generic code asks of a model, answered next to the model.

Generic code (export, backbones, the registry, pipeline and tensor parallelism in
``trainers.parallel``) never names a model family. It asks :func:`family_of` for the
:class:`ModelFamily` of a model (or of a model class) and calls its methods; each family
(ResNeSt and ResNet in ``modelzoo.vision``, BERT in ``modelzoo.nlp``, the GNNs in
``modelzoo.graph``) subclasses :class:`ModelFamily` next to its model and registers an
instance with :func:`register_family`. A method a family does not answer raises
:class:`FamilyError` (a ``TypeError``) naming the family and what it lacks, so a new family
adds only what it supports: ResNet-50 v1b's family is one class in its model file.

This module imports nothing from the families, and the families import only it (and shared
utilities), so the package has no import circle (``tests/test_imports.py`` checks the graph).

Example:
    >>> import modelzoo
    >>> from modelzoo.family import family_of
    >>> family_of(modelzoo.get_model("resnest14")).name
    'ResNeSt'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "FamilyError",
    "FeatureSpec",
    "ModelFamily",
    "Modality",
    "family_of",
    "find_family",
    "get_modality",
    "list_families",
    "register_family",
    "register_modality",
]

MODALITIES = ("image", "text", "graph", "tabular")


class FamilyError(TypeError):
    """A model is of no registered family, or its family does not support what was asked."""


@dataclass(frozen=True)
class FeatureSpec:
    """How a family's classification model splits into a backbone
    (:class:`~modelzoo.features.FeatureListNet`).

    Attributes:
        sequence: Top-level children of the model in the order its forward runs them, from
            the input to the last stage (everything after it, pool and classifier, is left out).
        modules: For each feature index, the child of ``sequence`` whose output it is.
        reductions: For each feature index, input side / feature-map side.
        channels: ``channels(model)`` gives each feature index's channels for one instance.
        notes: For each feature index, a short description for docs and errors.
    """

    sequence: tuple[str, ...]
    modules: tuple[str, ...]
    reductions: tuple[int, ...]
    channels: Callable[[nn.Module], list[int]]
    notes: tuple[str, ...]

    def __post_init__(self) -> None:
        counts = {len(self.modules), len(self.reductions), len(self.notes)}
        if len(counts) != 1:
            raise ValueError(
                f"FeatureSpec: modules, reductions and notes need one entry per feature "
                f"index, got {len(self.modules)}, {len(self.reductions)} and {len(self.notes)}"
            )
        missing = [m for m in self.modules if m not in self.sequence]
        if missing:
            raise ValueError(f"FeatureSpec: modules {missing} are not in sequence {self.sequence}")

    @property
    def num_features(self) -> int:
        return len(self.modules)

    def describe(self) -> str:
        """``"0: stem (reduction 2), 1: layer1 (reduction 4), ..."``."""
        return ", ".join(
            f"{i}: {note} (reduction {r})"
            for i, (note, r) in enumerate(zip(self.notes, self.reductions, strict=True))
        )

    def check_out_indices(self, out_indices: Sequence[int] | None, owner: str) -> tuple[int, ...]:
        """``out_indices`` as a tuple (``None``: every feature index, like timm).

        Raises:
            ValueError: Not a non-empty sequence of distinct integers in the valid range.
        """
        last = self.num_features - 1
        if out_indices is None:
            return tuple(range(self.num_features))
        valid = (
            isinstance(out_indices, (tuple, list))
            and len(out_indices) > 0
            and all(isinstance(i, int) and not isinstance(i, bool) for i in out_indices)
            and all(0 <= i <= last for i in out_indices)
            and len(set(out_indices)) == len(out_indices)
        )
        if not valid:
            raise ValueError(
                f"{owner}: out_indices must be a non-empty tuple of distinct integers in "
                f"0..{last} ({self.describe()}), got {out_indices!r}"
            )
        return tuple(out_indices)


class ModelFamily:
    """What generic code may ask of a family's models; subclass it next to the model.

    Class attributes:
        name: The family's name in messages (``"ResNeSt"``).
        model_classes: The model classes of the family (their subclasses belong to it too).
        modality: What its models read: ``"image"``, ``"text"``, ``"graph"`` or ``"tabular"``.
        classifiers: The classes whose single tensor output is class logits (export names
            it ``logits``; other tensors are named ``output``).
        features: The backbone split (``get_model(..., features_only=True)``), or ``None``.

    Every method's default raises :class:`FamilyError`: a family answers what it supports.
    """

    name: str = ""
    model_classes: tuple[type[nn.Module], ...] = ()
    modality: str = "image"
    classifiers: tuple[type[nn.Module], ...] = ()
    features: FeatureSpec | None = None

    def _unsupported(self, what: str) -> FamilyError:
        return FamilyError(f"{what}: the {self.name} family does not support it")

    # ---- export ----------------------------------------------------------------------------

    def example_inputs(
        self, model: nn.Module, *, batch_size: int, generator: torch.Generator, **sizes: Any
    ) -> tuple[Any, ...]:
        """Default positional inputs of ``model``'s forward (on the CPU; the caller moves
        them). ``sizes`` are the keyword sizes of :func:`modelzoo.export.example_inputs`
        (``image_size``, ``seq_len``, ``num_nodes``, ``num_edges``, ``num_graphs``); a
        family reads those it needs."""
        raise self._unsupported(f"example_inputs({type(model).__name__})")

    def inputs_like(
        self, model: nn.Module, inputs: tuple[Any, ...]
    ) -> dict[str, Any]:  # pragma: no cover - every exportable family answers
        """Keyword sizes for :func:`modelzoo.export.example_inputs` that differ from those of
        ``inputs`` (to check that a trace did not bake a size in)."""
        raise self._unsupported(f"inputs_like({type(model).__name__})")

    def dynamic_shapes(self, model: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """``torch.export`` dynamic shapes of ``inputs``; default: dimension 0 of every
        tensor is one shared batch."""
        from torch.export import Dim

        batch = Dim("batch", min=1)
        return tuple(
            {0: batch} if isinstance(t, torch.Tensor) and t.dim() else None for t in inputs
        )

    #: ``example_inputs`` options a TorchScript trace needs (it takes tensors only).
    tracing_options: dict[str, Any] = {}

    def output_axes(self, model: nn.Module, inputs: tuple[Any, ...]) -> dict[tuple[int, int], str]:
        """Names of output dimensions that follow a dynamic non-tensor input, by
        ``(output index, dimension)`` (ONNX names them; default: none)."""
        return {}

    def export_view(self, model: nn.Module, inputs: tuple[Any, ...]) -> nn.Module | None:
        """A module to export in place of ``model`` whose forward returns a plain tuple, for a
        model whose output is a NamedTuple or holds ``None`` (``None``: the generic view)."""
        return None

    # ---- pipeline parallelism --------------------------------------------------------------

    def pipeline_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The chain of blocks of ``model`` (sharing its parameters) that pipeline stages cut:
        block ``i``'s outputs are block ``i + 1``'s inputs; the first takes the model's
        inputs, the last gives its output (as a tensor or a plain tuple)."""
        raise self._unsupported(f"pipeline parallelism of {type(model).__name__}")

    def pipeline_block_names(self, model: nn.Module, count: int) -> list[str]:
        """Names of the ``count`` blocks of :meth:`pipeline_blocks` (plans and profiles)."""
        return [f"block{i}" for i in range(count)]

    def pipeline_output(self, model: nn.Module) -> Callable[[Any], Any]:
        """Turns the last block's output back into ``model``'s own output type."""
        return lambda out: out

    def profile_inputs(
        self,
        model: nn.Module,
        batch: int,
        *,
        seq_len: int | None,
        image_size: int | None,
        generator: torch.Generator,
        owner: str,
    ) -> tuple[torch.Tensor, ...]:
        """One micro-batch of ``batch`` random samples for the planner's profiler."""
        raise self._unsupported(f"{owner}: profiling {type(model).__name__}")

    # ---- tensor parallelism ----------------------------------------------------------------

    #: Hugging Face's ``base_model_tp_plan`` for each layer of :meth:`tensor_parallel_layers`:
    #: submodule path -> ``"colwise"`` or ``"rowwise"`` (``None``: not tensor-parallel).
    tp_plan: dict[str, str] | None = None
    #: The layer's attention submodule, whose fused ``qkv`` projection over ``num_heads``
    #: heads of ``head_dim`` tensor parallelism regroups rank-major and divides.
    tp_attention: str | None = None

    def tensor_parallel_layers(self, model: nn.Module) -> list[nn.Module]:
        """The layers whose linear maps tensor parallelism splits."""
        raise self._unsupported(f"tensor parallelism of {type(model).__name__}")

    def is_tensor_parallel_layer(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the layers :meth:`tensor_parallel_layers` returns."""
        return False

    def unsplit_copy(self, model: nn.Module) -> nn.Module:
        """A freshly built plain model of ``model``'s class and configuration (its weights
        are loaded by the caller)."""
        raise self._unsupported(f"copying {type(model).__name__}")

    # ---- planner ---------------------------------------------------------------------------

    def build_for_planning(self, builder: Callable[..., nn.Module], overrides: dict[str, Any],
                           name: str) -> nn.Module:  # fmt: skip
        """The model a training script trains for the planner to profile (on the meta
        device, which the caller sets); ``overrides`` change the family's configuration."""
        if overrides:
            raise ValueError(f"model config overrides are for BERTs; {name} is not one")
        return builder()

    def __repr__(self) -> str:
        return f"<ModelFamily {self.name}>"


class Modality:
    """What a kind of input needs, whatever the model: its preprocessing, built from the
    options stored with weights or an artifact (torchvision's ``Weights.transforms``), and
    how an artifact of it stores its model. Each modality is registered by the package that
    implements it (``modelzoo.vision``, ``modelzoo.nlp``, ``modelzoo.graph``).

    Class attributes:
        name: ``"image"``, ``"text"``, ``"graph"`` or ``"tabular"``.
        required_options: Preprocessing options an artifact of this modality must hold.
        needs_tokenizer: Its artifacts are saved with a tokenizer (text).
        registered_model: Its artifacts are rebuilt by the registry's builder of their
            ``model`` name (``False``: by :meth:`load_model`, from the folder's own files).
    """

    name: str = ""
    required_options: tuple[str, ...] = ()
    needs_tokenizer: bool = False
    registered_model: bool = True

    def transforms(self, options: dict[str, Any], owner: str) -> Callable[[Any], Any]:
        """The evaluation preprocessing for ``options`` (e.g. ``input_size``, ``mean``)."""
        raise ValueError(
            f"{owner}: {self.name} inputs are preprocessed by their tokenizer; call "
            ".tokenizer() instead of .transforms()"
        )

    def tokenizer(self, *, owner: str, vocab: Any = None, directory: Any = None,
                  progress: bool = True) -> Any:  # fmt: skip
        """The tokenizer of a published vocabulary (``vocab``) or of an artifact folder."""
        raise ValueError(f"{owner}: {self.name} inputs have no tokenizer; use .transforms()")

    def save_model(self, model: nn.Module, tokenizer: Any, directory: Any) -> bool:
        """Writes ``model`` (and ``tokenizer``) into artifact folder ``directory`` in the
        modality's own format; ``False``: the generic safetensors file is written instead."""
        return False

    def load_model(self, directory: Any, model_kwargs: dict[str, Any],
                   overrides: dict[str, Any]) -> nn.Module:  # fmt: skip
        """Rebuilds an artifact's model from its folder (modalities whose artifacts are not
        rebuilt by the registry, ``registered_model=False``)."""
        raise ValueError(
            f"{directory}: {self.name} artifacts are rebuilt by the registry's builder of "
            "their model name"
        )


_MODALITIES: dict[str, Modality] = {}


def register_modality(modality: Modality) -> Modality:
    """Makes ``modality`` the answer of :func:`get_modality` for its name.

    Raises:
        ValueError: An unknown or already registered name.
    """
    if modality.name not in MODALITIES:
        raise ValueError(
            f"register_modality: name must be one of {MODALITIES}, got {modality.name!r}"
        )
    if modality.name in _MODALITIES:
        raise ValueError(f"register_modality: {modality.name!r} is already registered")
    _MODALITIES[modality.name] = modality
    return modality


def get_modality(name: str) -> Modality:
    """The registered :class:`Modality` called ``name``.

    Raises:
        ValueError: None is registered under that name.
    """
    if name not in _MODALITIES:
        raise ValueError(
            f"modality {name!r} is not registered (registered: {sorted(_MODALITIES)}); "
            "import the package that implements it"
        )
    return _MODALITIES[name]


_FAMILIES: list[ModelFamily] = []


def register_family(family: ModelFamily) -> ModelFamily:
    """Makes ``family`` the answer of :func:`family_of` for its model classes.

    Raises:
        ValueError: A class already belongs to a registered family, or the family has no
            name, no classes or an unknown modality.
    """
    if not family.name or not family.model_classes:
        raise ValueError(f"register_family: {family!r} needs a name and model_classes")
    if family.modality not in MODALITIES:
        raise ValueError(
            f"register_family({family.name}): modality must be one of {MODALITIES}, "
            f"got {family.modality!r}"
        )
    for known in _FAMILIES:
        if known.name == family.name:
            raise ValueError(f"register_family: a family named {family.name!r} is registered")
        for cls in family.model_classes:
            if cls in known.model_classes:
                raise ValueError(
                    f"register_family: {cls.__qualname__} already belongs to the "
                    f"{known.name!r} family"
                )
    _FAMILIES.append(family)
    return family


def list_families() -> list[ModelFamily]:
    """The registered families, in registration order."""
    return list(_FAMILIES)


def find_family(model: nn.Module | type) -> ModelFamily | None:
    """The family of a model or model class, or ``None``: the family that registered the
    nearest class in its method resolution order. A wrapper (a backbone) names the family of
    what it wraps in its ``model_family`` attribute."""
    declared = getattr(model, "model_family", None)
    if isinstance(declared, ModelFamily):
        return declared
    cls = model if isinstance(model, type) else type(model)
    for base in cls.__mro__:
        for family in _FAMILIES:
            if base in family.model_classes:
                return family
    return None


def family_of(model: nn.Module | type, what: str = "") -> ModelFamily:
    """The family of a model or model class.

    Raises:
        FamilyError: ``model`` is of no registered family; the message names them.
    """
    family = find_family(model)
    if family is None:
        cls = model if isinstance(model, type) else type(model)
        known = ", ".join(f.name for f in _FAMILIES)
        prefix = f"{what}: " if what else ""
        raise FamilyError(
            f"{prefix}{cls.__qualname__} is of no registered model family (known: {known}); "
            "subclass modelzoo.family.ModelFamily next to the model and register it"
        )
    return family
