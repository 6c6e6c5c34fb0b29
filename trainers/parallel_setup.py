"""Model parallelism from the command line: the flags, the :class:`ParallelSetup` they
describe, and the meshes and pipelines built from it (docs/model_parallel.md).

A script adds the flags with :func:`add_tensor_parallel_args` (``--tensor-parallel``,
``--pipeline-parallel``, ``--micro-batches``, ``--pipeline-schedule``,
``--pipeline-boundaries``, ``--plan``), lets :func:`apply_plan` fill them in from the
planner's plan, and lays its model out with :func:`apply_model_parallel`, which works on
:func:`parallel_config` of the parsed flags: the code that builds device meshes and
pipelines reads a :class:`ParallelSetup`, never argparse. Only these functions import
:mod:`trainers.parallel` (``torch.distributed.tensor`` and ``pipelining``), when a run
splits its model, so that parsing the flags stays quick. :mod:`trainers.cli` re-exports
the names the scripts use.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .cli_parser import brief
from .comm import combiner_class, list_combiners
from .dist import DistEnv

__all__ = [
    "ParallelSetup",
    "add_tensor_parallel_args",
    "apply_model_parallel",
    "apply_plan",
    "apply_tensor_parallel",
    "parallel_config",
    "tensor_parallel_mesh",
    "unsplit_for_saving",
]


@dataclasses.dataclass(frozen=True)
class ParallelSetup:
    """How a run splits its model over its processes, and what else the run does that has to
    agree with the split.

    Not :class:`trainers.parallel.plan.ParallelConfig` (a plan's placement: every degree,
    the data-parallel one included, the micro-batches and boundaries resolved): here the
    data-parallel degree follows from the world size at launch, and the micro-batches,
    boundaries and plan may be left to their defaults.

    Attributes:
        tensor_parallel: ranks that split every Transformer layer (``--tensor-parallel``).
        pipeline_parallel: pipeline stages (``--pipeline-parallel``).
        micro_batches: micro-batches per pipeline step (``None``: one per stage).
        schedule: ``"1f1b"`` or ``"gpipe"`` (``--pipeline-schedule``).
        boundaries: the block where each stage starts, and the end (``None``: balanced by
            parameter count).
        plan: the planner's plan file the degrees came from (``--plan``), if any.
        grad_combine: the ``--grad-combine`` mode; a split model needs one whose class
            ``supports_tensor_parallel``.
        elastic: elastic training (``--elastic-dir``), which a split model cannot do.
        model_ema: a weight average (``--model-ema``), which a split model cannot keep yet.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    micro_batches: int | None = None
    schedule: str = "1f1b"
    boundaries: tuple[int, ...] | None = None
    plan: str | None = None
    grad_combine: str = "average"
    elastic: bool = False
    model_ema: bool = False


def _degree(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    n = 1 if value is None else int(value)
    if n < 1:
        raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {n}")
    return n


def parallel_config(args: argparse.Namespace) -> ParallelSetup:
    """The :class:`ParallelSetup` of parsed :func:`add_tensor_parallel_args` flags (after
    :func:`apply_plan`); a script without some of the flags gets their defaults.

    Raises:
        SystemExit: a degree below 1.
    """
    boundaries = getattr(args, "pipeline_boundaries", None)
    pp = _degree(args, "pipeline_parallel")
    return ParallelSetup(
        tensor_parallel=_degree(args, "tensor_parallel"),
        pipeline_parallel=pp,
        micro_batches=getattr(args, "micro_batches", None),
        schedule=getattr(args, "pipeline_schedule", None) or "1f1b",
        boundaries=None if boundaries is None else tuple(boundaries),
        plan=getattr(args, "plan", None) or None,
        grad_combine=getattr(args, "grad_combine", "average"),
        elastic=bool(getattr(args, "elastic_dir", None)),
        model_ema=bool(getattr(args, "model_ema", False)),
    )


def _setup(setup: ParallelSetup | argparse.Namespace) -> ParallelSetup:
    """``setup``, or :func:`parallel_config` of parsed flags."""
    return setup if isinstance(setup, ParallelSetup) else parallel_config(setup)


# ---- the flags ----------------------------------------------------------------------------------
def _boundaries(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected block indices separated by commas, e.g. 0,4,8; got {text!r}"
        ) from None


def add_tensor_parallel_args(
    parser: argparse.ArgumentParser, *, tensor: bool = True, pipeline: bool = True
) -> None:
    """``--tensor-parallel N`` (``tensor=True``: BERTs) and (``pipeline=True``)
    ``--pipeline-parallel N --micro-batches M --pipeline-schedule --pipeline-boundaries``."""
    g = parser.add_argument_group("model parallelism (docs/model_parallel.md)")
    if not tensor:
        parser.set_defaults(tensor_parallel=1)
    else:
        g.add_argument(
            "--tensor-parallel",
            type=int,
            default=1,
            metavar="N",
            help="split every Transformer layer over N processes (Megatron's layout on "
            "DTensor); the world (torchrun's processes) becomes WORLD/N data-parallel "
            "replicas of N ranks",
        )
        brief(parser, "--tensor-parallel")
    g.add_argument(
        "--plan",
        type=str,
        default=None,
        metavar="FILE",
        help="a placement from the planner (python -m trainers.parallel.plan ... --json FILE): "
        "its tensor/pipeline degrees, micro-batches, schedule and stage boundaries; the run's "
        "world size, model and global batch must be the plan's",
    )
    if not pipeline:
        return
    g.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        metavar="N",
        help="cut the model into N pipeline stages, one per process (torch.distributed."
        "pipelining); the world becomes WORLD/N data-parallel replicas of N stages",
    )
    g.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per pipeline step (--batch-size must divide by M; default: the "
        "number of stages)",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=("1f1b", "gpipe"),
        default=None,
        help="1f1b (the default): one forward, one backward (activations of at most N "
        "micro-batches); gpipe: all forwards, then all backwards",
    )
    g.add_argument(
        "--pipeline-boundaries",
        type=_boundaries,
        default=None,
        metavar="B0,B1,...",
        help="the block where each stage starts, and the end (default: balanced by parameter "
        "count; the planner, python -m trainers.parallel.plan, gives measured ones)",
    )
    brief(parser, "--pipeline-parallel")


_PLAN_FLAGS = (
    ("tensor_parallel", "--tensor-parallel", 1),
    ("pipeline_parallel", "--pipeline-parallel", 1),
    ("micro_batches", "--micro-batches", None),
    ("pipeline_schedule", "--pipeline-schedule", None),
    ("pipeline_boundaries", "--pipeline-boundaries", None),
)


def apply_plan(
    args: argparse.Namespace,
    env: DistEnv,
    *,
    model_name: str | None,
    batch_size: int,
    accumulate: int,
    seq_len: int | None = None,
    image_size: int | None = None,
) -> None:
    """``--plan FILE``: set the model-parallel flags of ``args`` from the planner's plan
    (:func:`trainers.parallel.plan.load_plan`), after checking that this run is the one
    planned: the world size is the plan's devices, ``model_name`` (when the script knows it)
    the plan's model, and ``batch_size x accumulate`` per rank the plan's global batch over its
    data-parallel replicas (pipeline: one batch of ``micro_batches`` micro-batches, no
    accumulation; otherwise ``micro_batches`` accumulation steps). A flag given on the command
    line with another value than the plan's is an error. Call it before the run-log header
    is written, so that the header holds the placement the run uses; the plan's predicted
    step time and its memory are printed on rank 0. Does nothing without ``--plan``."""
    path = getattr(args, "plan", None)
    if not path:
        return
    from .parallel.plan import load_plan  # noqa: PLC0415 (only with --plan)

    try:
        plan = load_plan(path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--plan {path}: {err}") from None
    pp, tp, dp, micro = (plan.pipeline_parallel, plan.tensor_parallel, plan.data_parallel,
                         plan.micro_batches)  # fmt: skip
    if plan.devices != env.world_size:
        raise SystemExit(
            f"--plan {path} places {plan.devices} devices (tp {tp} x pp {pp} x dp {dp}); this "
            f"run has {env.world_size} process(es): start it with that many (torchrun "
            "--nproc-per-node / --nnodes) or plan for this world size"
        )
    if model_name is not None and plan.model != model_name:
        raise SystemExit(
            f"--plan {path} was made for the model {plan.model!r}; this run trains "
            f"{model_name!r}: plan this model (python -m trainers.parallel.plan --model "
            f"{model_name} ...)"
        )
    if seq_len is not None and plan.seq_len is not None and plan.seq_len != seq_len:
        raise SystemExit(
            f"--plan {path} was profiled at sequence length {plan.seq_len}; this run uses "
            f"{seq_len}: plan with --seq-len {seq_len} or run at {plan.seq_len}"
        )
    if image_size is not None and plan.image_size is not None and plan.image_size != image_size:
        raise SystemExit(
            f"--plan {path} was profiled at image size {plan.image_size}; this run uses "
            f"{image_size}: plan with --image-size {image_size} or run at {plan.image_size}"
        )
    per_replica = plan.global_batch // dp
    want = (per_replica, 1) if pp > 1 else (per_replica // micro, micro)
    if (batch_size, accumulate) != want:
        what = "one batch in" if pp > 1 else "accumulation steps of"
        raise SystemExit(
            f"--plan {path} is for a global batch of {plan.global_batch} = dp {dp} x "
            f"{per_replica} per replica, {what} {micro} micro-batches of "
            f"{per_replica // micro}; this run has a batch of {batch_size} per rank x "
            f"accumulate {accumulate}: pass a batch size of {want[0]} and accumulate {want[1]}"
        )
    values: dict[str, Any] = {"tensor_parallel": tp, "pipeline_parallel": pp}
    if pp > 1:
        values.update(micro_batches=micro, pipeline_schedule=plan.schedule,
                      pipeline_boundaries=list(plan.boundaries))  # fmt: skip
    for name, flag, unset in _PLAN_FLAGS:
        if name not in values:
            continue
        if not hasattr(args, name):
            if values[name] != unset:
                raise SystemExit(f"--plan {path} needs {flag} {values[name]}, which this "
                                 "script does not offer")  # fmt: skip
            continue
        given = getattr(args, name)
        if given != unset and given != values[name]:
            raise SystemExit(
                f"{flag} {given} contradicts --plan {path}, which sets {values[name]}; "
                f"drop {flag} or the plan"
            )
        setattr(args, name, values[name])
    if env.is_main:
        print(
            f"--plan {path}: tp {tp} x pp {pp} x dp {dp}, {micro} micro-batch(es), "
            f"{plan.schedule}, boundaries {list(plan.boundaries)}; predicted step "
            f"{plan.predicted_step_s:.4g} s, {plan.memory_per_device_bytes / 2**30:.2f} GiB "
            "per device",
            file=sys.stderr,
        )


def _check_plan_blocks(path: str, model: nn.Module) -> None:
    """The model a run builds has the planned model's number of pipeline blocks
    (:func:`~trainers.parallel.pipeline.model_blocks`), so the plan's boundaries cut it where
    the planner meant."""
    from .parallel.pipeline import model_blocks  # noqa: PLC0415
    from .parallel.plan import load_plan  # noqa: PLC0415

    planned = load_plan(path).profile.get("blocks")
    try:
        blocks = len(model_blocks(model))
    except TypeError:
        return  # a model the pipeline cannot cut: the degrees are all the plan gives it
    if planned is not None and planned != blocks:
        raise SystemExit(
            f"--plan {path} was profiled on a model of {planned} blocks; this run's model has "
            f"{blocks}: plan the model this run builds"
        )


# ---- the meshes and pipelines -------------------------------------------------------------------
def _check_split(setup: ParallelSetup, env: DistEnv, flag: str, n: int) -> None:
    """The run can be split over ``n`` ranks as ``flag`` asks (one line naming the fix)."""
    if env.world_size % n:
        raise SystemExit(
            f"{flag} {n} needs a world size divisible by {n}; this run has "
            f"{env.world_size} process(es) (torchrun --nproc-per-node)"
        )
    if setup.elastic:
        raise SystemExit(
            f"{flag} and --elastic-dir do not combine: a model-parallel replica cannot change "
            "its width; run elastic training data-parallel"
        )
    if setup.model_ema:
        raise SystemExit(
            f"--model-ema does not run on a model split by {flag} yet (its copy would be "
            f"split too); drop one of --model-ema and {flag}"
        )
    if not combiner_class(setup.grad_combine).supports_tensor_parallel:
        modes = " / ".join(
            m for m in list_combiners() if combiner_class(m).supports_tensor_parallel
        )
        raise SystemExit(f"{flag} runs with --grad-combine {modes} (got {setup.grad_combine!r})")


def tensor_parallel_mesh(setup: ParallelSetup | argparse.Namespace, env: DistEnv) -> Any:
    """The ``(dp, tp)`` device mesh of ``--tensor-parallel N`` (``None`` for ``N = 1``), after
    checking that the run can be split that way. ``setup``: a :class:`ParallelSetup` or parsed
    flags (:func:`parallel_config` of them), as for the functions below."""
    setup = _setup(setup)
    tp = setup.tensor_parallel
    if tp == 1:
        return None
    _check_split(setup, env, "--tensor-parallel", tp)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        env.device.type, (env.world_size // tp, tp), mesh_dim_names=("dp", "tp")
    )


def apply_tensor_parallel(
    setup: ParallelSetup | argparse.Namespace, env: DistEnv, model: nn.Module
) -> tuple[nn.Module, DistEnv]:
    """Lay ``model`` out over ``--tensor-parallel N`` ranks; returns it and the environment
    the Trainer and the data should see (the data-parallel view of ``env``; ``env`` itself
    with ``N = 1``)."""
    mesh = tensor_parallel_mesh(setup, env)
    if mesh is None:
        return model, env
    from .parallel.tensor import parallelize_bert

    parallelize_bert(model, mesh["tp"])
    return model, env.data_parallel(mesh["dp"])


def apply_model_parallel(
    setup: ParallelSetup | argparse.Namespace,
    env: DistEnv,
    model: nn.Module,
    *,
    inputs_of: Callable[[Any], Sequence[torch.Tensor]] | None = None,
    batch_size: int | None = None,
) -> tuple[nn.Module, DistEnv]:
    """``--tensor-parallel`` (:func:`apply_tensor_parallel`) or ``--pipeline-parallel N``:
    ``model`` as a :class:`trainers.parallel.PipelinedModel` over a ``(dp, pp)`` mesh, and the
    data-parallel view of ``env``. Both (``--tensor-parallel T --pipeline-parallel N``): a
    ``(dp, pp, tp)`` mesh in Megatron's rank order, each stage's layers split over ``T``
    ranks. ``setup``: a :class:`ParallelSetup` or parsed flags; ``inputs_of(batch)``: the
    model's positional inputs; ``batch_size``: the per-rank batch to split into
    micro-batches (default: the parsed flags' ``--batch-size``). With ``--plan`` (already
    applied by :func:`apply_plan`), ``model`` must have as many blocks as the planned one."""
    if batch_size is None and not isinstance(setup, ParallelSetup):
        batch_size = setup.batch_size
    setup = _setup(setup)
    if setup.plan:
        _check_plan_blocks(setup.plan, model)
    pp, tp = setup.pipeline_parallel, setup.tensor_parallel
    if pp == 1:
        return apply_tensor_parallel(setup, env, model)
    flag = "--pipeline-parallel" if tp == 1 else "--tensor-parallel x --pipeline-parallel"
    _check_split(setup, env, flag, pp * tp)
    micro = setup.micro_batches if setup.micro_batches is not None else pp
    if micro < 1:
        raise SystemExit(f"--micro-batches must be >= 1, got {micro}")
    if batch_size is None:
        raise TypeError("apply_model_parallel: pass batch_size= (the per-rank batch) with a setup")
    if batch_size % micro:
        raise SystemExit(
            f"the batch size {batch_size} does not split into --micro-batches {micro}; make the "
            "batch size a multiple of the micro-batches"
        )
    if inputs_of is None:
        raise SystemExit(f"--pipeline-parallel: {type(model).__name__} has no pipeline inputs")
    from torch.distributed.device_mesh import init_device_mesh

    from .parallel.pipeline import PipelinedModel

    # Megatron-LM's rank order, tensor parallel innermost (the planner's):
    # rank = replica * (pp * tp) + stage * tp + tp_index.
    if tp == 1:
        mesh = init_device_mesh(
            env.device.type, (env.world_size // pp, pp), mesh_dim_names=("dp", "pp")
        )
    else:
        mesh = init_device_mesh(
            env.device.type, (env.world_size // (pp * tp), pp, tp),
            mesh_dim_names=("dp", "pp", "tp"),
        )  # fmt: skip
    try:
        pipelined = PipelinedModel(
            model, group=mesh["pp"].get_group(), micro_batches=micro, inputs_of=inputs_of,
            schedule=setup.schedule, boundaries=setup.boundaries, device=env.device,
            tensor_mesh=mesh["tp"] if tp > 1 else None,
        )  # fmt: skip
    except (TypeError, ValueError) as err:
        raise SystemExit(f"{flag} {pp if tp == 1 else f'{tp} x {pp}'}: {err}") from None
    return pipelined, env.data_parallel(mesh["dp"])


def unsplit_for_saving(model: nn.Module) -> nn.Module:
    """``model``, or for a tensor- or pipeline-parallel one the whole single-process model (a
    collective over its group: call it on every rank before rank 0 saves)."""
    from ._dtensor import is_pipeline_parallel, is_tensor_parallel

    if is_pipeline_parallel(model):
        model.synchronize()  # type: ignore[operator]
        model = model.full_model  # type: ignore[assignment]  (tensor-parallel inside: unsplit)
    if not is_tensor_parallel(model):
        return model
    from .parallel.tensor import unsplit_model

    return unsplit_model(model)
