"""Loads timm's model code as a test oracle, without torchvision.

The reference is timm itself (``pip install --no-deps timm==1.0.31``; its other imports,
``huggingface_hub``, ``safetensors`` and ``pyyaml``, are already in the test environment).
``import timm`` imports torchvision at import time, for its data pipeline
(``timm.data``: transforms, data sets) and for ``FrozenBatchNorm2d`` (``timm.layers``); its
model code (``timm/models/resnet.py``) uses none of it. torchvision is not installable beside
the CPU torch here (see ``DESIGN.md``), so when it is absent or fails to import, a stand-in
finder answers ``torchvision.*`` with placeholder modules for the duration of ``import timm``
only: every placeholder is removed from ``sys.modules`` afterwards, so nothing else in the test
session sees a ``torchvision``. With a working torchvision, timm is imported as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

TIMM_VERSION = "1.0.31"
INSTALL = f"pip install --no-deps timm=={TIMM_VERSION}"


class _PlaceholderMeta(type):
    """A placeholder class whose attributes are placeholder classes (``InterpolationMode.
    BILINEAR`` at import time); hashable and subclassable, never instantiated by the models."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (), {})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (), {})


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _forget(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def timm_available() -> bool:
    return importlib.util.find_spec("timm") is not None


def load_timm() -> types.ModuleType:
    """Returns the ``timm`` module (see the module docstring).

    Raises:
        RuntimeError: timm is not installed; the message has the pip command.
    """
    if "timm" in sys.modules:
        return sys.modules["timm"]
    if not timm_available():
        raise RuntimeError(f"timm is the oracle of these tests: {INSTALL}")
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import timm

            return timm
        except Exception:  # a torchvision that does not fit this torch
            _forget("timm")
            _forget("torchvision")
    finder = _TorchvisionStandIn()
    sys.meta_path.insert(0, finder)
    try:
        import timm
    finally:
        sys.meta_path.remove(finder)
        _forget("torchvision")
    return timm
