"""The combiner protocol, the registry of ``--grad-combine`` modes, and byte counting.

The trainer's loop never talks to ``DistributedDataParallel`` or to any collective directly;
it calls a :class:`GradCombiner` at fixed points of every optimizer step::

    model_fwd = combiner.prepare(model, optimizer, env)   # once: wrap (DDP) or keep the module
    skip = combiner.skips_step()                    # True: the update is decided without us
    for each micro-batch of the step (none computed when skip):
        with combiner.no_sync() if not last else nullcontext():
            loss = train_step(model_fwd, batch); backward(loss / n)
    combiner.reduce_gradients(scaler)               # grads still carry the fp16 loss scale
    scaler.unscale_(optimizer); clip_grad_norm_(...)   # trainer (if fp16 / clipping)
    set the learning rate                            # trainer
    combiner.step(optimizer, scaler)                # the (combined) optimizer step
    scaler.update(); optimizer.zero_grad()           # trainer
    combiner.metrics()                              # extra numbers for the step records

``close()`` is called when :meth:`~trainers.Trainer.fit` ends (every rank): modes with a
communication thread stop it there (a later step may start it again).

``synchronize()`` is called before every evaluation: combiners whose replicas drift apart
(CSER, the local-SGD family) make them equal there; ``end_evaluation()`` after it (DEF goes
back from the evaluated average to its local models). ``metrics()`` reports ``bytes_sent`` (what
one worker sends per optimizer step), ``grad_bytes`` (the dense fp32 gradient) and
``compression_ratio`` when the world has more than one rank.

``state_dict()`` is saved **per rank** in checkpoints (residuals, local optimizer moments
differ between ranks) and given back to the same rank on resume when the world size is
unchanged, after the trainer has loaded the model and rank 0's optimizer state; after a
world-size change (an elastic membership change) ``load_state_dict`` is not called:
``load_other_world(states)`` gets every old rank's state instead (modes whose replicas
differ rebuild the exact average of the old replicas there; the default starts fresh from
rank 0's model).

**Registry.** Every mode is one class, registered with its name and a frozen options
dataclass that owns every default::

    @dataclass(frozen=True)
    class MyOptions:
        period: int = option(4, "steps between averagings", flag="--my-period")

    @register_combiner("mine", MyOptions)
    class MyCombiner(GradCombiner):
        ...                                  # self.options.period, self.seed

    create_combiner("mine", period=8, seed=0)    # or create_combiner(CombinerConfig(...))

``list_combiners()`` gives the ``--grad-combine`` choices; ``trainers.cli`` builds each mode's
flags, help texts and defaults from its options class, so adding a mode is adding one class.
Options validate themselves in ``__post_init__`` and their errors name the option.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..dist import DistEnv
from .cost import ring_allreduce_time
from .flat import broadcast_, model_tensors

__all__ = [
    "CommCounter",
    "CountingCombiner",
    "GradCombiner",
    "NoOptions",
    "combiner_class",
    "create_combiner",
    "list_combiners",
    "option",
    "refuse_loss_scaling",
    "register_combiner",
    "unwrap_model",
]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` (or ``torch.compile``) wrapper."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def option(
    default: Any,
    help: str,  # noqa: A002 - the argparse word
    *,
    flag: str | None = None,
    choices: Callable[[], list[str]] | tuple[str, ...] | None = None,
) -> Any:
    """A field of a combiner's options dataclass: its default, help text and CLI flag.

    ``flag`` defaults to ``--<field-name-with-dashes>``; several modes may share one flag
    (``--local-steps``) with their own defaults. ``choices`` is a tuple or a callable
    returning the valid values (evaluated when the CLI is built).
    """
    return dataclasses.field(
        default=default, metadata={"help": help, "flag": flag, "choices": choices}
    )


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a mode that has none."""


class GradCombiner:
    """Base class: a world of independent ranks that each step on their own gradients.

    Subclasses override the hooks they need; see the module docstring for when the trainer
    calls each one. The base implementation does no communication at all (correct for a
    world of one).

    Args:
        options: an instance of the class's ``Options`` dataclass (default: its defaults,
            updated by ``overrides``).
        seed: the run seed, for modes that draw random numbers (identical on every rank).
        **overrides: option values, e.g. ``LocalSGDCombiner(period=4)``.
    """

    name: str = "base"
    Options: type = NoOptions
    summary: str = ""  # one line for --grad-combine's help and the docs table
    # Whether the mode runs on a tensor-parallel model (DTensor parameters, trainers.parallel)
    # with a data-parallel view of the world (DistEnv.data_parallel).
    supports_tensor_parallel: bool = False
    # Whether prepare() may be called again on a re-formed process group and the mode go on
    # from a member's model and optimizer (in-process recovery, trainers.recovery).
    regroups_in_process: bool = False

    @classmethod
    def is_deterministic(cls, options: Any) -> bool:
        """Whether runs with these options repeat bit for bit (same seed, same machine).

        False for modes whose communication races the computation (asynchronous gossip);
        ``scripts/reproduce.py`` then only checks the claim statistically.
        """
        return True

    def __init__(self, options: Any = None, *, seed: int = 0, **overrides: Any) -> None:
        cls = type(self).Options
        if options is None:
            options = cls(**overrides)
        else:
            if not isinstance(options, cls):
                raise TypeError(
                    f"{type(self).__name__} takes {cls.__name__}, got {type(options).__name__}"
                )
            if overrides:
                options = dataclasses.replace(options, **overrides)
        self.options = options
        self.seed = int(seed)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.env: DistEnv | None = None

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        """Called once; returns the module the trainer calls ``train_step`` with."""
        self.model = model
        self.optimizer = optimizer
        self.env = env
        return model

    def wrap(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, env: DistEnv | None = None
    ) -> Any:
        """This mode in a plain PyTorch loop (Horovod's ``DistributedOptimizer``): prepares
        the mode for ``model`` and returns a :class:`~trainers.comm.wrap.DistributedOptimizer`
        whose ``step()`` combines and updates; call its ``.model``. ``env`` defaults to
        :meth:`DistEnv.from_env` (an existing default process group is used as is)."""
        from .wrap import DistributedOptimizer  # noqa: PLC0415 (wrap imports this module)

        return DistributedOptimizer(self, optimizer, model, env)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context for the backward of a non-final micro-step (skip communication)."""
        yield

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        """After the final backward, before unscaling and clipping: combine ``p.grad``."""

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        """Perform the optimizer step (through ``scaler.step`` when a scaler is given)."""
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()

    def synchronize(self) -> None:
        """Before evaluation (a collective): make diverged replicas equal (no-op here)."""

    def end_evaluation(self) -> None:
        """After evaluation (every rank): undo what :meth:`synchronize` set up only for the
        evaluation (DEF evaluates an averaged model, then trains on from its local ones)."""

    def data_shard(self) -> tuple[int, int]:
        """``(part, parts)``: this rank trains on shard ``part`` of the ``parts`` disjoint
        shards of every global batch (after :meth:`prepare`; default: its rank in the world).
        CodedReduce gives several ranks the same shard."""
        env = self.env
        return (env.rank, env.world_size) if env is not None else (0, 1)

    def data_parts(self, world_size: int) -> int:
        """How many disjoint shards a global batch has at ``world_size`` ranks; callable
        before :meth:`prepare`, for the steps per epoch of an lr schedule (a global batch is
        ``batch x accumulation x data_parts``). The world size, fewer where ranks share data
        (CodedReduce)."""
        return world_size

    # ---- the mode's cost (scripts/scaling_whatif.py, on trainers.comm.cost's model) ------------
    def comm_time(self, grad_bytes: float, workers: int, gbps: float, latency_s: float) -> float:
        """``T_m``: seconds of one step's communication of a ``grad_bytes`` gradient (or
        model) among ``workers`` ranks joined at ``gbps`` with ``latency_s`` per message
        (:mod:`trainers.comm.cost`). Here a ring all-reduce of the whole gradient every step;
        modes that communicate otherwise (Pipe-SGD's timing, gossip, CodedReduce's tree)
        answer their own."""
        return ring_allreduce_time(grad_bytes, workers, gbps, latency_s)

    def step_time(
        self, compute: float, comm: float, *, straggler: float = 1.0, overlap: float = 0.0
    ) -> tuple[float, float]:
        """``(fast ranks, straggler)`` seconds per step, with ``compute`` (``T_c``) a normal
        rank's computation, ``comm`` the mode's :meth:`comm_time` (``T_m``), the slowest
        rank's computation ``straggler`` (``s``) times longer and ``overlap`` (``o``) the
        share of the computation that hides communication (DDP's bucketed backward). Here:
        the all-reduce after the backward makes every rank wait for the slowest,
        ``s T_c + max(0, T_m - o T_c)``."""
        t = straggler * compute + max(0.0, comm - overlap * compute)
        return t, t

    def skips_step(self) -> bool:
        """Before an optimizer step's first forward: ``True`` when this rank's gradient cannot
        matter any more (CodedReduce: a late rank whose step the root has already decided), so
        the trainer skips the step's forward and backward (the batches are still drawn) and
        calls :meth:`reduce_gradients` with no gradients. Not asked before a fit's first
        step (the trainer computes one step to learn the metric names that a skipping rank
        still reports as zeros). Default: never."""
        return False

    def checkpoint_model(self) -> dict[str, Any] | None:
        """Before a checkpoint (a collective, every rank): the model state its ``model`` entry
        holds, or ``None`` for the module's own (rank 0's). DEF gives the averaged model."""
        return None

    def metrics(self) -> dict[str, float]:
        """Extra numbers for the step records (e.g. bytes sent per step)."""
        return {}

    def close(self) -> None:
        """When ``fit`` ends, on every rank: stop background communication (no-op here)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (saved per rank)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank (called after :meth:`prepare`)."""

    def load_other_world(self, states: list[dict[str, Any]]) -> None:
        """After a world-size change: every old rank's :meth:`state_dict` (in rank order).

        Called instead of :meth:`load_state_dict`, after the trainer has loaded rank 0's
        model and optimizer. The default keeps rank 0's model and starts fresh.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"


class CountingCombiner(GradCombiner):
    """A mode that does its own communication and counts it: a :class:`CommCounter` in
    ``self.counter`` (what :meth:`metrics` reports), and :meth:`start_replicas`, the part of
    :meth:`prepare` these modes share."""

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.counter = CommCounter()  # bytes this rank sends per step

    def start_replicas(self, model: nn.Module, env: DistEnv, *, broadcast: bool = True) -> None:
        """The part of :meth:`prepare` every communicating mode shares: count bytes against
        this model's dense gradient (:class:`CommCounter`) and, with ``broadcast`` (modes that
        keep their own replicas; DDP broadcasts by itself), start every rank from rank 0's
        parameters and buffers."""
        self.counter.set_model(model)
        if broadcast and env.distributed:
            broadcast_(model_tensors(model))


def refuse_loss_scaling(scaler: torch.amp.GradScaler | None, mode: str, why: str) -> None:
    """fp16 loss scaling cannot be used by ``mode`` (``why``): say so and what to do."""
    if scaler is not None:
        raise ValueError(
            f"combiner {mode!r} {why}, which fp16 loss scaling would corrupt; train in "
            "bfloat16 or float32 precision"
        )


# ---- the registry ------------------------------------------------------------------------------
_COMBINERS: dict[str, type[GradCombiner]] = {}
_C = TypeVar("_C", bound=type[GradCombiner])


def register_combiner(name: str, options: type | None = None) -> Callable[[_C], _C]:
    """Class decorator: register a :class:`GradCombiner` as ``--grad-combine name``.

    Raises:
        ValueError: the name is taken.
        TypeError: ``options`` is not a frozen dataclass.
    """
    key = name.lower()
    opts = NoOptions if options is None else options
    if not dataclasses.is_dataclass(opts) or not opts.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"combiner {name!r}: options must be a frozen dataclass, got {opts!r}")

    def decorate(cls: _C) -> _C:
        if key in _COMBINERS:
            raise ValueError(
                f"combiner {key!r} is already registered ({_COMBINERS[key].__qualname__}); "
                "pick another name"
            )
        if not (isinstance(cls, type) and issubclass(cls, GradCombiner)):
            raise TypeError(f"combiner {key!r}: {cls!r} is not a GradCombiner subclass")
        cls.name = key
        cls.Options = opts
        _COMBINERS[key] = cls
        return cls

    return decorate


def list_combiners() -> list[str]:
    """The registered modes, in registration order (``average`` first)."""
    return list(_COMBINERS)


def combiner_class(name: str) -> type[GradCombiner]:
    """The class registered as ``name``; unknown names suggest close ones."""
    key = name.lower()
    if key not in _COMBINERS:
        close = difflib.get_close_matches(key, list(_COMBINERS), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"unknown combiner {name!r}{hint}; available: {', '.join(list_combiners())}"
        )
    return _COMBINERS[key]


def create_combiner(config: Any, *, seed: int = 0, **overrides: Any) -> GradCombiner:
    """A combiner from a :class:`~trainers.config.CombinerConfig` or a mode name.

    Args:
        config: a ``CombinerConfig`` (mode + options) or a registered name.
        seed: the run seed (see :class:`GradCombiner`).
        **overrides: option values on top of the config's.
    """
    if isinstance(config, str):
        return combiner_class(config)(seed=seed, **overrides)
    cls = combiner_class(config.mode)
    return cls(config.options, seed=seed, **overrides)


# ---- byte counting -------------------------------------------------------------------------------
class CommCounter:
    """Bytes one worker sends, summed between two :meth:`metrics` calls (the log interval).

    ``grad_bytes`` is the size of the dense fp32 gradient; ``compression_ratio`` is
    ``grad_bytes / bytes_sent`` (1 for plain averaging; above 1 when sending less). Modes
    that message chosen peers (gossip) also count ``peers``: the ranks this worker exchanged
    with per step, averaged like the bytes. The compressed modes also count ``wire_bytes``,
    what the collective hands to the network per step (an all-gather: ``N - 1`` copies of the
    payload; :mod:`trainers.comm.sparse`: its measured messages), and ``collective``, the
    collective or sparse-allreduce algorithm that ran.
    """

    def __init__(self) -> None:
        self.grad_bytes = 0
        self.bytes = 0
        self.steps = 0
        self.peers: int | None = None  # None: the mode does not count peers
        self.total_bytes = 0  # since the start (or since the combiner was created)
        self.wire: int | None = None  # None: the mode does not count the collective's bytes
        self.collectives: list[str] = []

    def add_wire(self, nbytes: int, collective: str) -> None:
        """What the collective itself handed to the network (``wire_bytes``: an all-gather
        sends ``N - 1`` copies of the payload), and which collective ran."""
        self.wire = (self.wire or 0) + int(nbytes)
        if collective not in self.collectives:
            self.collectives.append(collective)

    def add_peers(self, count: int) -> None:
        self.peers = (self.peers or 0) + int(count)

    def set_model(self, model: nn.Module) -> None:
        """``grad_bytes`` = the model's trainable parameters in fp32."""
        self.grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)

    def add(self, nbytes: int) -> None:
        self.bytes += int(nbytes)
        self.total_bytes += int(nbytes)

    def step(self) -> None:
        self.steps += 1

    def metrics(self) -> dict[str, float]:
        if self.steps == 0:
            return {}
        per_step = self.bytes / self.steps
        out = {
            "bytes_sent": per_step,
            "grad_bytes": float(self.grad_bytes),
            "compression_ratio": self.grad_bytes / per_step if per_step else math.inf,
        }
        if self.peers is not None:
            out["peers"] = self.peers / self.steps
            self.peers = 0
        if self.wire is not None:
            out["wire_bytes"] = self.wire / self.steps
            out["collective"] = "+".join(self.collectives)  # type: ignore[assignment]
            self.wire, self.collectives = 0, []
        self.bytes, self.steps = 0, 0
        return out
