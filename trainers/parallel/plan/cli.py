"""The command line, ``python -m trainers.parallel.plan`` (:func:`main`): profile or read a
profile, search, print the best plans and write the best one."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from trainers.parallel.plan.network import Network
from trainers.parallel.plan.predict import (
    DEFAULT_OPTIMIZER_STATE_FACTOR,
    SCHEDULES,
    InfeasiblePlanError,
    Plan,
    save_plan,
)
from trainers.parallel.plan.profile import load_profile, save_profile
from trainers.parallel.plan.profiling import profile_model
from trainers.parallel.plan.search import DEFAULT_MAX_MICRO_BATCHES, top_plans


def _int_list(flag: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated positive integers, e.g. 1,2,4,8; got {text!r}"
            )
        return values

    return parse


def _overrides(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(
                f"--bert-config takes key=value pairs, e.g. num_layers=48,hidden_size=1600; got "
                f"{item!r}"
            )
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _table(plans: Sequence[Plan]) -> str:
    head = (
        f"{'#':>2} {'tp':>3} {'pp':>3} {'dp':>4} {'M':>4} {'mb':>4} {'schedule':>8} "
        f"{'step s':>10} {'steady':>9} {'bubble':>9} {'update':>9} {'GiB/dev':>8}  boundaries"
    )
    lines = [head]
    for rank, p in enumerate(plans, 1):
        b = p.breakdown
        lines.append(
            f"{rank:>2} {p.tensor_parallel:>3} {p.pipeline_parallel:>3} {p.data_parallel:>4} "
            f"{p.micro_batches:>4} {b['micro_batch_size']:>4} {p.schedule:>8} "
            f"{p.predicted_step_s:>10.4g} {b['steady_s']:>9.3g} {b['bubble_s']:>9.3g} "
            f"{b['update_s']:>9.3g} {p.memory_per_device_bytes / 2**30:>8.2f}  "
            f"{list(p.boundaries)}"
        )
    return "\n".join(lines)


def _stages(p: Plan) -> str:
    lines = [
        f"best plan, per stage (per micro-batch of {p.breakdown['micro_batch_size']}; "
        "update = exposed dp all-reduce + optimizer step):",
        f"{'stage':>5} {'blocks':>9} {'fwd s':>9} {'bwd s':>9} {'tp comm':>9} {'p2p':>9} "
        f"{'update':>9} {'held':>5} {'GiB':>7}",
    ]
    for s, st in enumerate(p.breakdown["stages"]):
        update = st["dp_allreduce_exposed_s"] + st["optimizer_s"]
        lines.append(
            f"{s:>5} {st['blocks'][0]:>4}-{st['blocks'][1] - 1:<4} {st['forward_s']:>9.3g} "
            f"{st['backward_s']:>9.3g} {st['tp_allreduce_s']:>9.3g} {st['p2p_s']:>9.3g} "
            f"{update:>9.3g} {st['in_flight']:>5} {st['memory_bytes'] / 2**30:>7.2f}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainers.parallel.plan",
        description="Choose tensor/pipeline/data-parallel degrees, stage boundaries, "
        "micro-batches and schedule for a zoo model (see the module docstring for the model).",
    )
    p.add_argument("--model", help="zoo model name (BERTs: span-QA head; ResNeSt)")
    p.add_argument("--seq-len", type=int, default=None, help="BERT sequence length")
    p.add_argument("--image-size", type=int, default=None, help="ResNeSt input size")
    p.add_argument("--bert-config", type=_overrides, default={},
                   help="BertConfig fields replacing the model's, e.g. "
                   "num_layers=48,hidden_size=1600,num_heads=16,intermediate_size=6400")  # fmt: skip
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--memory-gb", type=float, required=True, help="memory per device, GiB")
    p.add_argument("--network", required=True,
                   help='levels innermost first, "size:gbps:latency_s,...", e.g. '
                   '"8:2400:3e-6,2:200:1e-5"; a level may add ":CHUNK@SECONDS/...", a ring '
                   "all-reduce step's measured time per chunk size")  # fmt: skip
    source = p.add_mutually_exclusive_group()
    source.add_argument("--profile", default=None, help="read this profile JSON")
    source.add_argument("--save-profile", default=None, help="profile here and write it")
    p.add_argument("--profile-batch", type=int, default=4, help="profiling micro-batch")
    p.add_argument("--profile-larger-batches", type=_int_list("--profile-larger-batches"),
                   default=[], help="micro-batches above --profile-batch also timed, e.g. "
                   "16,64: the plans' larger micro-batches are interpolated between measured "
                   "times, not extrapolated")  # fmt: skip
    p.add_argument("--profile-repeats", type=int, default=5)
    p.add_argument("--optimizer-state-factor", type=float, default=DEFAULT_OPTIMIZER_STATE_FACTOR,
                   help="bytes kept per parameter byte (4: weights, grads, Adam's moments)")  # fmt: skip
    p.add_argument("--overlap", type=float, default=0.0,
                   help="fraction of the backward the dp all-reduce hides behind (0..1)")  # fmt: skip
    p.add_argument("--ranks-per-core", type=float, default=1.0,
                   help="ranks sharing one core, for a rehearsal with more ranks than cores "
                        "on one machine (the lab: devices / cores) whose profile was taken "
                        "with every rank busy: a pipeline's bubble then runs faster "
                        "(1: a core or a device per rank)")  # fmt: skip
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--compute-scale", type=float, default=None,
                       help="multiply the profile's times (a device 1/x times as fast)")  # fmt: skip
    scale.add_argument("--device-tflops", type=float, default=None,
                       help="scale the profile's times so its blocks run at this TFLOP/s")  # fmt: skip
    p.add_argument("--max-tp", type=int, default=8)
    p.add_argument("--max-pp", type=int, default=8)
    p.add_argument("--micro-batches", type=_int_list("--micro-batches"), default=None,
                   help="candidate micro-batch counts (default: divisors of the per-replica "
                   f"batch up to {DEFAULT_MAX_MICRO_BATCHES})")  # fmt: skip
    p.add_argument("--min-micro-batch-size", type=int, default=1,
                   help="smallest micro-batch (samples) to consider; an accelerator needs "
                   "enough work per micro-batch, which a CPU profile does not show")  # fmt: skip
    p.add_argument("--schedules", default="gpipe,1f1b", help="candidate schedules")
    p.add_argument("--runtime-only", action="store_true",
                   help="only placements trainers.parallel runs (no tensor parallelism for a "
                   "model without splittable blocks, e.g. ResNeSt)")  # fmt: skip
    p.add_argument("--top", type=int, default=5, help="print the K best plans")
    p.add_argument("--json", default=None, help="write the best plan here (atomically)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); exit 2 on a usage error or when nothing fits."""
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, value in (("--global-batch", args.global_batch), ("--devices", args.devices),
                        ("--top", args.top), ("--max-tp", args.max_tp), ("--max-pp", args.max_pp),
                        ("--profile-batch", args.profile_batch),
                        ("--min-micro-batch-size", args.min_micro_batch_size),
                        ("--profile-repeats", args.profile_repeats)):  # fmt: skip
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if not args.memory_gb > 0:
        parser.error(f"--memory-gb must be > 0, got {args.memory_gb}")
    if not 0 <= args.overlap <= 1:
        parser.error(f"--overlap must be in [0, 1], got {args.overlap}")
    if not args.ranks_per_core >= 1:
        parser.error(f"--ranks-per-core must be >= 1, got {args.ranks_per_core}")
    if args.optimizer_state_factor < 0:
        parser.error(f"--optimizer-state-factor must be >= 0, got {args.optimizer_state_factor}")
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    if not schedules or any(s not in SCHEDULES for s in schedules):
        parser.error(f"--schedules takes a comma-separated subset of {','.join(SCHEDULES)}, "
                     f"got {args.schedules!r}")  # fmt: skip
    try:
        network = Network.parse(args.network, devices=args.devices)
    except ValueError as exc:
        parser.error(f"--network: {exc}")
    if args.profile is not None:
        try:
            profile = load_profile(args.profile)
        except ValueError as exc:
            parser.error(f"--profile: {exc}")
        for flag, asked, measured in (("--seq-len", args.seq_len, profile.seq_len),
                                      ("--image-size", args.image_size, profile.image_size)):  # fmt: skip
            if asked is not None and asked != measured:
                parser.error(f"{flag} {asked} but --profile {args.profile} was measured at "
                             f"{measured}; profile again at {asked} (--save-profile)")  # fmt: skip
        if args.model is not None and args.model.lower() != profile.model.lower():
            parser.error(f"--model {args.model} but --profile {args.profile} profiles "
                         f"{profile.model}; drop --model or profile that model")  # fmt: skip
    else:
        if args.model is None:
            parser.error("give --model to profile (or --profile with a saved profile)")
        low = [b for b in args.profile_larger_batches if b <= args.profile_batch]
        if low:
            parser.error(f"--profile-larger-batches {low} must be above --profile-batch "
                         f"{args.profile_batch}")  # fmt: skip
        try:
            profile = profile_model(
                args.model, seq_len=args.seq_len, image_size=args.image_size,
                batch=args.profile_batch, repeats=args.profile_repeats,
                overrides=args.bert_config, larger_batches=args.profile_larger_batches,
            )  # fmt: skip
        except ValueError as exc:
            parser.error(f"--model {args.model}: {exc}")
        if args.save_profile:
            save_profile(profile, args.save_profile)
            print(f"wrote profile {args.save_profile}")
    if args.compute_scale is not None:
        if not args.compute_scale > 0:
            parser.error(f"--compute-scale must be > 0, got {args.compute_scale}")
        profile = profile.scaled(args.compute_scale)
    elif args.device_tflops is not None:
        rate = profile.achieved_tflops()
        if not args.device_tflops > 0:
            parser.error(f"--device-tflops must be > 0, got {args.device_tflops}")
        if rate <= 0:
            parser.error("--device-tflops needs FLOP counts in the profile ('flops' fields)")
        profile = profile.scaled(rate / args.device_tflops)
    try:
        plans = top_plans(
            profile, network, global_batch=args.global_batch,
            memory_bytes=args.memory_gb * 2**30, k=args.top,
            optimizer_state_factor=args.optimizer_state_factor, overlap=args.overlap,
            ranks_per_core=args.ranks_per_core, max_tp=args.max_tp, max_pp=args.max_pp,
            micro_batches=args.micro_batches,
            schedules=schedules, runtime_only=args.runtime_only,
            min_micro_batch_size=args.min_micro_batch_size,
        )  # fmt: skip
    except InfeasiblePlanError as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    scale = profile.source.get("compute_scale")
    rate = profile.achieved_tflops()
    print(
        f"plans for {profile.description()}; profiled at micro-batch {profile.batch} on "
        f"{profile.source.get('device', '?')} {profile.source.get('cpu_capability', '')}"
        f"{f', times x {scale:.3g}' if scale else ''}"
        f"{f' ({rate:.3g} TFLOP/s)' if rate else ''}; global batch {args.global_batch}, "
        f"{args.devices} devices of {args.memory_gb:g} GiB, network {network}"
    )
    print(_table(plans))
    print()
    print(_stages(plans[0]))
    if args.json:
        save_plan(plans[0], args.json)
        print(f"\nwrote {args.json}")
    return 0
