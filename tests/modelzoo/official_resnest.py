"""Loads the official ResNeSt PyTorch implementation as a test oracle.

The reference is the authors' own package (``pip install --no-deps resnest==0.0.6b20211013``,
the README's test command installs it). Only its model files are used; their single
dependency beyond torch, fvcore's name registry, is replaced by a minimal stand-in so the
package's heavier requirements (fvcore, iopath) are not needed.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

OFFICIAL_VERSION = "0.0.6b20211013"
_PKG = "_official_resnest_models"


class _Registry:
    def register(self):
        return lambda fn: fn


def load_official():
    """Returns the official ``resnest.torch.models`` ``resnest`` and ``ablation`` modules."""
    if _PKG in sys.modules:
        pkg = sys.modules[_PKG]
        return pkg.resnest, pkg.ablation
    spec = importlib.util.find_spec("resnest")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "The official ResNeSt package is the oracle of these tests: "
            f"pip install --no-deps resnest=={OFFICIAL_VERSION}"
        )
    models_dir = Path(spec.origin).parent / "torch" / "models"
    pkg = types.ModuleType(_PKG)
    pkg.__path__ = [str(models_dir)]
    sys.modules[_PKG] = pkg
    build = types.ModuleType(f"{_PKG}.build")
    build.RESNEST_MODELS_REGISTRY = _Registry()
    sys.modules[f"{_PKG}.build"] = build
    for name in ("splat", "resnet", "resnest", "ablation"):
        sub_spec = importlib.util.spec_from_file_location(
            f"{_PKG}.{name}", models_dir / f"{name}.py"
        )
        module = importlib.util.module_from_spec(sub_spec)
        sys.modules[f"{_PKG}.{name}"] = module
        sub_spec.loader.exec_module(module)
        setattr(pkg, name, module)
    return pkg.resnest, pkg.ablation
