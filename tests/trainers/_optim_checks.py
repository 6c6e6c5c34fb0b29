"""Checks shared by the LAMB and LANS tests: problems, float64 numpy runners, sync traps.

The numpy reference rules themselves live in test_lamb.py / test_lans.py, transcribed from
the spec's formulas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# Shapes like a conv net's: a conv kernel, a matrix, a vector, a scalar-like vector,
# an all-zero weight (trust ratio falls back to 1) and one whose gradient is always zero.
SHAPES = [(4, 3, 3, 3), (5, 7), (17,), (1,), (6, 6), (3, 4)]
ZERO_WEIGHT, ZERO_GRAD = 4, 5
STEPS = 20


def make_problem(
    seed: int = 0, grad_scale: float = 1.0
) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Initial weights and STEPS gradient lists (float64), with the zero cases built in."""
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(s) * 0.5 for s in SHAPES]
    weights[ZERO_WEIGHT][...] = 0.0
    grads = []
    for _ in range(STEPS):
        gs = [rng.standard_normal(s) * grad_scale for s in SHAPES]
        gs[ZERO_GRAD][...] = 0.0
        grads.append(gs)
    return weights, grads


def run_torch(
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    weights: list[np.ndarray],
    grads: list[list[np.ndarray]],
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> list[np.ndarray]:
    params = [nn.Parameter(torch.tensor(w, dtype=dtype, device=device)) for w in weights]
    opt = make_opt(params)
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = torch.tensor(g, dtype=dtype, device=device)
        opt.step()
    return [p.detach().double().cpu().numpy() for p in params]


def assert_close_lists(actual, expected, *, rtol: float, atol: float) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"tensor {i} {SHAPES[i]}")


# ---- no host synchronisation ----------------------------------------------------------------
class HostSync(AssertionError):
    pass


_SYNCING = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def host_reads_raise() -> Iterator[None]:
    """Make every Python-level read of a tensor value (``.item()``, ``bool(t)``, ...) raise."""
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}

    def trap(name):
        def raise_(self, *args, **kwargs):
            raise HostSync(f"Tensor.{name} called during step()")

        return raise_

    try:
        for name in _SYNCING:
            setattr(torch.Tensor, name, trap(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def step_on_meta(make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
    """Two steps with parameters on the meta device: any read of a value raises there."""
    params = [nn.Parameter(torch.empty(s, device="meta")) for s in SHAPES]
    opt = make_opt(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.empty_like(p)
        opt.step()


# ---- a real problem -------------------------------------------------------------------------
def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn's 8x8 handwritten digits, 1/4 held out (fixed permutation)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(x))
    x = torch.tensor(x[perm] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[perm], dtype=torch.long)
    n_val = len(x) // 4
    return x[n_val:], y[n_val:], x[:n_val], y[:n_val]


def train_digits_mlp(name: str, *, lr: float, epochs: int = 10, batch: int = 128) -> float:
    """Train a 64-128-10 MLP on the digits with ``create_optimizer(name)``; held-out top-1."""
    from trainers.optim import create_optimizer

    xt, yt, xv, yv = digits_split()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))
    opt = create_optimizer(name, model, lr=lr, weight_decay=0.01, no_wd=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(len(xt), generator=g).split(batch):
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        return (model(xv).argmax(1) == yv).float().mean().item()
