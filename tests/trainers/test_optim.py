"""create_optimizer / param_groups: GluonCV --no-wd grouping and the SGD/NAG update rules."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from trainers.optim import (
    create_optimizer,
    factory,
    list_optimizers,
    param_groups,
    register_optimizer,
)

# Names GluonCV's '.*beta|.*gamma|.*bias' pattern would pick in the same network.
NO_WD = {
    "bn.weight",
    "bn.bias",
    "conv2.bias",
    "gn.weight",
    "gn.bias",
    "fc.bias",
    "ln.weight",
    "ln.bias",
    "scale",
}
DECAY = {"conv1.weight", "conv2.weight", "fc.weight"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(3, 4, 3, bias=False),
                bn=nn.BatchNorm2d(4),
                conv2=nn.Conv2d(4, 4, 3),
                gn=nn.GroupNorm(2, 4),
                pool=nn.AdaptiveAvgPool2d(1),
                flat=nn.Flatten(),
                fc=nn.Linear(4, 5),
                ln=nn.LayerNorm(5),
            )
        )
        self.scale = nn.Parameter(torch.ones(5))  # a free 1-D parameter
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def _names(model: nn.Module, params: list[nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {n.removeprefix("body.") for n, p in model.named_parameters() if id(p) in ids}


def test_no_wd_groups_exactly_bias_norm_and_1d_params():
    model = Net()
    groups = param_groups(model, 1e-4, no_wd=True)
    assert len(groups) == 2
    decay, plain = groups
    assert (decay["weight_decay"], decay["no_wd"]) == (1e-4, False)
    assert (plain["weight_decay"], plain["no_wd"]) == (0.0, True)
    assert _names(model, decay["params"]) == DECAY
    assert _names(model, plain["params"]) == NO_WD


def test_without_no_wd_one_group_of_trainable_params():
    model = Net()
    (group,) = param_groups(model, 1e-4, no_wd=False)
    assert group["weight_decay"] == 1e-4 and group["no_wd"] is False
    assert _names(model, group["params"]) == DECAY | NO_WD  # not 'frozen'


def test_shared_parameter_appears_once():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    groups = param_groups(model, 0.1, no_wd=True)
    assert sum(len(g["params"]) for g in groups) == 2


def test_create_optimizer_uses_groups_and_flags():
    model = Net()
    opt = create_optimizer("sgd", model, lr=0.1, weight_decay=1e-4, no_wd=True)
    assert isinstance(opt, torch.optim.SGD)
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]
    assert [g["no_wd"] for g in opt.param_groups] == [False, True]
    assert all(g["momentum"] == 0.9 and not g["nesterov"] for g in opt.param_groups)


def test_nag_is_nesterov_sgd():
    opt = create_optimizer("NAG", Net(), lr=0.1, momentum=0.8)
    assert isinstance(opt, torch.optim.SGD)
    assert all(g["nesterov"] and g["momentum"] == 0.8 for g in opt.param_groups)


def _one_step(name: str, lr: float, wd: float, momentum: float):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    opt = create_optimizer(name, model, lr=lr, weight_decay=wd, momentum=momentum, no_wd=True)
    model(torch.randn(8, 4)).square().sum().backward()
    gw, gb = model.weight.grad.clone(), model.bias.grad.clone()
    opt.step()
    return model, (w0, gw), (b0, gb)


def test_sgd_step_matches_hand_formula():
    lr, wd = 0.1, 0.01
    model, (w, gw), (b, gb) = _one_step("sgd", lr, wd, momentum=0.9)
    # First step: the momentum buffer is the gradient itself; bias is in the no-wd group.
    torch.testing.assert_close(model.weight.detach(), w - lr * (gw + wd * w))
    torch.testing.assert_close(model.bias.detach(), b - lr * gb)


def test_nag_step_matches_mxnet_nag_formula():
    # MXNet NAG: mom = m*mom + (g + wd*w); w -= lr * (g + wd*w + m*mom), mom starts at 0.
    lr, wd, m = 0.1, 0.01, 0.9
    model, (w, gw), (b, gb) = _one_step("nag", lr, wd, momentum=m)
    d = gw + wd * w
    torch.testing.assert_close(model.weight.detach(), w - lr * (d + m * d))
    torch.testing.assert_close(model.bias.detach(), b - lr * (gb + m * gb))


def test_adam_adds_l2_to_the_gradient():
    # Adam's first step moves by lr * m^ / (sqrt(v^) + eps) with m^ = d, v^ = d^2, where
    # d = g + wd * w (coupled L2, DGL's GNN recipes); AdamW would decay w outside of d.
    lr, wd, eps = 0.01, 0.5, 1e-8
    model, (w, gw), (b, gb) = _one_step("adam", lr, wd, momentum=0.0)
    d = gw + wd * w
    torch.testing.assert_close(model.weight.detach(), w - lr * d / (d.abs() + eps))
    torch.testing.assert_close(model.bias.detach(), b - lr * gb / (gb.abs() + eps))


def test_adamw_gets_betas_eps_and_extra_kwargs():
    opt = create_optimizer(
        "adamw", Net(), lr=1e-3, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-6, amsgrad=True
    )
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.99) and group["eps"] == 1e-6 and group["amsgrad"]
    assert group["weight_decay"] == 0.05


def test_unknown_name_lists_available():
    with pytest.raises(
        ValueError, match="unknown optimizer .rmsprop.*adamw, bertadam, lamb, lans, nag, sgd"
    ):
        create_optimizer("rmsprop", Net(), lr=0.1)


def test_misspelled_option_fails():
    with pytest.raises(TypeError):
        create_optimizer("sgd", Net(), lr=0.1, nesterof=True)


def test_no_trainable_parameters_fails():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        create_optimizer("sgd", model, lr=0.1)


def test_register_optimizer_class_gets_only_named_options(monkeypatch):
    monkeypatch.setattr(factory, "_OPTIMIZERS", dict(factory._OPTIMIZERS))

    @register_optimizer("toy")
    class Toy(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0):
            super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    assert "toy" in list_optimizers()
    opt = create_optimizer("toy", Net(), lr=0.5, betas=(0.5, 0.6), weight_decay=0.1, no_wd=True)
    assert isinstance(opt, Toy)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[1]["no_wd"] and opt.param_groups[0]["betas"] == (0.5, 0.6)
    with pytest.raises(ValueError, match="already registered"):
        register_optimizer("toy")(Toy)


def test_bertadam_follows_gluonnlps_update():
    """Oracle: GluonNLP's BERTAdam as its code applies it (adamw_update with the
    bias-corrected step size as eta), written in numpy."""
    import math

    import numpy as np

    from trainers.optim import BertAdam

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((5, 3))
    grads = [rng.standard_normal((5, 3)) for _ in range(4)]
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-6, 0.01
    w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        eta = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        w = w - eta * (m / (np.sqrt(v) + eps) + wd * w)
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = BertAdam([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-12)
    # ... and it is not torch's AdamW (eps and the weight decay are corrected differently).
    q = torch.nn.Parameter(torch.tensor(w0))
    adamw = torch.optim.AdamW([q], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for g in grads:
        q.grad = torch.tensor(g)
        adamw.step()
    assert not np.allclose(q.detach().numpy(), w, rtol=1e-9, atol=1e-9)
