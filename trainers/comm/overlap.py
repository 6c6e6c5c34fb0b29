"""Communication overlapped with the backward pass: buckets launched as their gradients land.

:class:`BackwardBuckets` is what ``DistributedDataParallel``'s reducer does, for combiners
whose reduction is not one all-reduce (Adasum's tree of point-to-point exchanges and small
dot-product sums): the trainable parameters are cut into buckets in backward order, a
``register_post_accumulate_grad_hook`` on every parameter counts the gradients each bucket
still waits for, and a bucket whose last gradient has been accumulated is handed to **one
worker thread** that runs the reduction while autograd computes the gradients of the layers
below.

**The order.** Like DDP, the first step guesses (the reverse of registration order) and
records the order in which the gradients actually arrive; the combiner then makes rank 0's
recorded order everybody's (:meth:`rebuild`), parameters that got no gradient last, and
cuts the buckets again. Both the overlapped and the plain path do this, after the same
step, so their buckets stay the same.

Rules that keep the ranks in step and the results those of the plain path:

* **One order.** The worker runs buckets strictly in index order: a bucket that is ready
  before an earlier one waits for it. Every rank therefore issues the same collectives in
  the same order, whatever order its hooks fired in.
* **Nothing left behind.** :meth:`finish` (the combiner's ``reduce_gradients``) hands over
  every bucket not yet launched (a parameter that got no gradient on this rank gets zeros
  first), in index order, and waits for the worker: a bucket another rank launched early is
  reduced here too.
* **Final gradients only.** Hooks launch nothing unless armed: the combiner disarms them
  inside ``no_sync()`` (gradient accumulation) and arms them after the first plain step.
* **Same arithmetic.** A bucket's reduction is the same function of the same gradients as
  in the plain path when the plain path cuts the same buckets (the combiner's job), so
  results are identical bit for bit; only the time at which each bucket starts changes.
* **Errors surface.** An exception in the worker is raised again by :meth:`finish`. A
  parameter whose gradient arrives twice in one step's final backward (two ``backward``
  calls in one micro-step) is an error, as in DDP: its bucket may already be out. Every
  backward while the hooks are armed must belong to a training step.

On CUDA each hook records an event on the current stream, and the worker's stream waits
for it before the bucket's reduction (the gradient is complete on the device).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["BackwardBuckets", "backward_order_buckets"]


def backward_order_buckets(params: Sequence[Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices into ``params`` (given in backward order), cut into consecutive buckets of
    at most ``cap_bytes`` each (a larger tensor gets a bucket of its own) and never mixing
    devices or dtypes."""
    buckets: list[list[int]] = []
    size, kind = 0, None
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if buckets and (p.device, p.dtype) == kind and size + nbytes <= cap_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size, kind = nbytes, (p.device, p.dtype)
    return buckets


class BackwardBuckets:
    """Hooks on ``params`` that launch ``reduce(bucket_index, grads)`` per bucket.

    Args:
        params: the parameters, first guess of backward order (every one requires a grad).
        cap_bytes: the bucket size (:func:`backward_order_buckets`).
        reduce: runs one bucket's collective on its gradients (in place), on the worker
            thread, under ``torch.no_grad()``.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        cap_bytes: int,
        reduce: Callable[[int, list[Tensor]], None],
    ) -> None:
        self.cap_bytes = cap_bytes
        self.reduce = reduce
        self.armed = False
        self.params: list[Tensor] = []
        self.buckets: list[list[int]] = []
        self._position: dict[Tensor, int] = {}
        self._bucket_of: dict[int, int] = {}
        self.arrival: list[int] = []  # indices in the order the gradients arrived (recorded)
        self.recording = True  # until rebuild()
        self._lock = threading.Lock()
        self._waiting: list[int] = []
        self._launched = 0  # buckets handed to the worker this step (a prefix of the order)
        self._events: dict[int, Any] = {}
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.launched_early = 0  # buckets hooks launched during this step's backward
        self.last_launched_early = 0  # the same for the last finished step
        self._layout(list(params))
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def _layout(self, params: list[Tensor]) -> None:
        self.params = params
        self.buckets = backward_order_buckets(params, self.cap_bytes)
        self._position = {p: i for i, p in enumerate(params)}
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._reset()

    def rebuild(self, order: Sequence[int]) -> None:
        """Lay the parameters out in ``order`` (a permutation of the current indices, the
        same on every rank) and cut the buckets again; recording stops."""
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"not a permutation of {len(self.params)} parameter indices")
        with self._lock:
            self._layout([self.params[i] for i in order])
            self.recording = False

    def observed_order(self) -> list[int]:
        """The recorded arrival order, then the parameters that got no gradient."""
        seen = list(dict.fromkeys(self.arrival))
        got = set(seen)
        return seen + [i for i in range(len(self.params)) if i not in got]

    # ---- the step's bookkeeping ---------------------------------------------------------
    def _reset(self) -> None:
        self._ready: set[int] = set()  # parameters whose gradient this step has accumulated
        self._waiting = [len(b) for b in self.buckets]
        self._launched = 0
        self._events = {}

    def _hook(self, param: Tensor) -> None:
        if not (self.armed or self.recording):
            return
        with self._lock:
            index = self._position[param]
            if self.recording:
                self.arrival.append(index)
            if not self.armed:
                return
            if index in self._ready:  # as DDP: a bucket must not go out half-accumulated
                raise RuntimeError(
                    f"a parameter of shape {tuple(param.shape)} got a second gradient in one "
                    "step's final backward while its bucket may already be reduced; the "
                    "overlapped reduction needs one backward per micro-step (use the "
                    "combiner's --no-...-overlap flag, or sum the losses first)"
                )
            self._ready.add(index)
            b = self._bucket_of[index]
            if param.grad is not None and param.grad.is_cuda:
                event = torch.cuda.Event()
                event.record()
                self._events.setdefault(b, []).append(event)
            self._waiting[b] -= 1
            while self._launched < len(self.buckets) and self._waiting[self._launched] <= 0:
                self._launch(self._launched)
                self.launched_early += 1

    def _launch(self, b: int) -> None:
        """Hand bucket ``b`` to the worker (the caller holds the lock; ``b`` is next)."""
        assert b == self._launched
        self._launched += 1
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="modelzoo-overlap", daemon=True)
            self._thread.start()
        self._queue.put((b, self._events.pop(b, [])))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            b, events = item
            try:
                if self._error is None:  # after a failure, drain without reducing
                    for event in events:
                        torch.cuda.current_stream().wait_event(event)
                    grads = [self.params[i].grad for i in self.buckets[b]]
                    with torch.no_grad():
                        self.reduce(b, grads)  # type: ignore[arg-type]
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                self._error = err
            finally:
                self._queue.task_done()

    # ---- the combiner's calls -------------------------------------------------------------
    def finish(self) -> None:
        """Launch every bucket not launched yet (zeros for missing gradients), wait for all
        of them, and re-raise a worker's exception. Call on every rank, every step."""
        with self._lock:
            for b in range(self._launched, len(self.buckets)):
                for i in self.buckets[b]:
                    p = self.params[i]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                self._launch(b)
        self._queue.join()
        self._reset()
        self.last_launched_early, self.launched_early = self.launched_early, 0
        error, self._error = self._error, None
        if error is not None:
            raise error

    def layout_state(self, model_params: Sequence[Tensor]) -> list[int] | None:
        """The adopted order as indices into ``model_params`` (for a checkpoint; ``None``
        before the first step has fixed it)."""
        if self.recording:
            return None
        index = {p: i for i, p in enumerate(model_params)}
        return [index[p] for p in self.params]

    def load_layout(
        self, model_params: Sequence[Tensor], order: Sequence[int], overlap: bool
    ) -> None:
        """Adopt a checkpoint's :meth:`layout_state` (a resumed run cuts the buckets of the
        run it continues) and arm the hooks when ``overlap``."""
        position = {p: i for i, p in enumerate(self.params)}
        try:
            self.rebuild([position[model_params[i]] for i in order])
        except (IndexError, KeyError, ValueError) as err:
            raise ValueError(
                f"the checkpoint's bucket order ({len(order)} entries) does not fit this "
                f"model's {len(self.params)} trainable parameters: {err}"
            ) from None
        self.armed = overlap

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The combiner's ``no_sync()``: accumulation micro-steps launch nothing."""
        armed, self.armed = self.armed, False
        try:
            yield
        finally:
            self.armed = armed

    def reduce_all(self) -> None:
        """The step's reduction, on every rank: :meth:`finish` when the hooks are armed, else
        every bucket in order on this thread (zeros for missing gradients), the same calls."""
        if self.armed:
            self.finish()
            return
        for bucket in self.buckets:
            for i in bucket:
                p = self.params[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        for b, bucket in enumerate(self.buckets):
            with torch.no_grad():
                self.reduce(b, [self.params[i].grad for i in bucket])  # type: ignore[misc]

    def end_step(self, overlap: bool) -> None:
        """After a step's reduction, on every rank (a collective the first time): after the
        first step, rank 0's recorded order becomes everybody's layout and the hooks are
        armed when ``overlap``."""
        if not self.recording:
            return
        device = self.params[0].device if self.params else torch.device("cpu")
        order = torch.tensor(self.observed_order(), dtype=torch.int64, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(order, 0)
        self.rebuild(order.tolist())
        self.armed = overlap

    def close(self) -> None:
        """Stop the worker thread (the next launch starts another)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._queue.join()
        self._thread = None

    def remove(self) -> None:
        """Stop the worker and remove the hooks."""
        self.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
