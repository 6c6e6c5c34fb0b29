"""Optimizer step time: our LAMB and LANS vs ``torch.optim.AdamW(foreach=True)``.

The parameter set is ResNeSt-50's: the 263 tensors (27.48M parameters) of the deep-stem,
radix-2 split-attention network with a 1000-class head, built here from the architecture
numbers (convolution kernels, split-attention fc layers with biases, BatchNorm weights and
biases), fp32, each with a fixed random gradient. AdamW is the peer because it is the
cheapest adaptive multi-tensor optimizer in PyTorch: LAMB and LANS do its work plus
per-tensor norms and trust ratios (LANS twice).

Each optimizer gets its own copy of the parameters. Rounds alternate AdamW, LAMB and LANS
in one process, ``--steps`` steps each; the per-step time of an optimizer is the median
over rounds (each round rotates which goes first). Lines ``<name> ... ratio=<adamw_time/
our_time>`` for LAMB and LANS with min/median/max, then the machine and the last line
``ratio=<...>``: the smaller (worse) of the two. Target (issue 41): ratio >= 0.77 (ours at
most 1.3x AdamW's time).

Usage: python benchmarks/bench_optim.py [--rounds 7] [--steps 5] [--device cpu] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _report import add_args, check_rounds, finish, spread

from trainers.optim import Lamb, Lans


def resnest50_shapes(num_classes: int = 1000) -> list[tuple[int, ...]]:
    """Parameter shapes of ResNeSt-50 (deep stem 32, radix 2, cardinality 1, avg-down)."""
    shapes: list[tuple[int, ...]] = []

    def bn(c: int) -> None:
        shapes.extend([(c,), (c,)])

    shapes.append((32, 3, 3, 3))
    bn(32)
    shapes.append((32, 32, 3, 3))
    bn(32)
    shapes.append((64, 32, 3, 3))
    bn(64)
    inplanes, radix = 64, 2
    for planes, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True):
        for block in range(blocks):
            width = planes  # bottleneck_width 64, cardinality 1
            inter = max(width * radix // 4, 32)
            shapes.append((width, inplanes, 1, 1))
            bn(width)
            shapes.append((width * radix, width // radix, 3, 3))  # split-attention conv
            bn(width * radix)
            shapes.extend([(inter, width, 1, 1), (inter,)])  # fc1 + bias
            bn(inter)
            shapes.extend([(width * radix, inter, 1, 1), (width * radix,)])  # fc2 + bias
            shapes.append((planes * 4, width, 1, 1))
            bn(planes * 4)
            if block == 0:
                shapes.append((planes * 4, inplanes, 1, 1))  # downsample conv
                bn(planes * 4)
            inplanes = planes * 4
    shapes.extend([(num_classes, 2048), (num_classes,)])
    return shapes


def make_params(shapes, device: str, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=g) * 0.05).to(device))
        p.grad = (torch.randn(s, generator=g) * 1e-3).to(device)
        params.append(p)
    return params


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(opt: torch.optim.Optimizer, steps: int, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5, help="steps per optimizer per round")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    add_args(p, rounds=7)
    args = p.parse_args()
    check_rounds(args.rounds)
    if args.threads:
        torch.set_num_threads(args.threads)

    shapes = resnest50_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(
        f"ResNeSt-50 parameter set: {len(shapes)} tensors, {numel / 1e6:.2f}M parameters, "
        f"{args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    hp = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999))
    optimizers = {
        "adamw": torch.optim.AdamW(
            make_params(shapes, args.device, 0), eps=1e-6, foreach=True, **hp
        ),
        "lamb": Lamb(make_params(shapes, args.device, 0), eps=1e-6, **hp),
        "lans": Lans(make_params(shapes, args.device, 0), eps=1e-6, **hp),
    }
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for opt in optimizers.values():  # warm-up: lazy state, allocator
        time_steps(opt, 2, args.device)
    names = list(optimizers)
    for r in range(args.rounds):
        for name in names[r % 3 :] + names[: r % 3]:  # rotate which goes first
            times[name].append(time_steps(optimizers[name], args.steps, args.device))

    median = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"adamw(foreach=True)  {spread(times['adamw'], 'ms/step', 1e3)}")
    ratios = {}
    for name in ("lamb", "lans"):
        ratios[name] = median["adamw"] / median[name]
        print(
            f"{name:<20} {spread(times[name], 'ms/step', 1e3)}  "
            f"({median[name] / median['adamw']:.2f}x adamw)  ratio={ratios[name]:.3f}"
        )
    worse = min(ratios, key=ratios.get)  # the headline: the slower of the two
    other = "lans" if worse == "lamb" else "lamb"
    finish(args.json, "bench_optim", times[worse], times["adamw"],
           ours_label=f"{worse.upper()} step (the slower of LAMB, LANS)",
           peer_label="torch.optim.AdamW(foreach=True) step", target=0.77,
           extra={f"{other}_rounds": times[other], f"{other}_ratio": ratios[other]})  # fmt: skip


if __name__ == "__main__":
    main()
