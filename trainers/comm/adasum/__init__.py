"""Adasum: adaptive summation across ranks (the rule, the kernels, the allreduce, the combiners).

Paper: Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021
(https://arxiv.org/abs/2006.02924). Semantics follow Horovod's ``op=hvd.Adasum``; the code is
plain ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Two vectors combine with the pairwise rule, applied per tensor (per layer, never to the
flattened model):

.. math::
    \\operatorname{adasum}(a, b) = \\Big(1 - \\frac{a \\cdot b}{2\\lVert a\\rVert^2}\\Big) a
                              + \\Big(1 - \\frac{a \\cdot b}{2\\lVert b\\rVert^2}\\Big) b

which is ``a + b`` for orthogonal vectors, the mean for parallel ones (``b = k a``, any
``k != 0``), ``b`` when ``a = 0``, and symmetric in ``a`` and ``b``. The dot product and squared
norms accumulate in float64; a side whose squared norm is below ``eps`` (Horovod's
``sqrt(DBL_MIN)``, about 1.5e-154) keeps coefficient 1, so a zero tensor contributes nothing
and never divides by zero.

Across ``N`` ranks the result is a binary tree: ranks (0, 1), (2, 3), ... combine, then those
results pairwise, and so on. :func:`adasum_allreduce_` computes it with Horovod's
vector-halving distance-doubling exchange (the bandwidth of a reduce-scatter + allgather): at
level ``l = 1, 2, 4, ...`` rank ``v`` and ``v ^ l`` split their current range in halves, each
keeps one half and receives the partner's copy of it, the per-tensor partial dot/norm sums
are added over the ``2 l`` ranks that share each tensor, and each rank applies the rule to
its half; the halves are then gathered back in reverse order.

**World sizes that are not a power of two** (Horovod refuses them): with ``N = 2^k + r``,
``0 < r < 2^k``, the first ``2 r`` ranks fold in adjacent pairs first — rank ``2i + 1`` sends
its whole buffer to rank ``2i``, which applies the pairwise rule — then the ``2^k`` survivors
(ranks ``0, 2, ..., 2r - 2, 2r, 2r + 1, ..., N - 1``) run the power-of-two tree, and rank
``2i`` sends the result back to ``2i + 1``. The result is the binary tree over the ranks in
order whose first ``r`` adjacent pairs are combined one level early::

    N = 3: adasum(adasum(x0, x1), x2)
    N = 5: adasum(adasum(adasum(x0, x1), x2), adasum(x3, x4))
    N = 6: adasum(adasum(adasum(x0, x1), adasum(x2, x3)), adasum(x4, x5))

The folding ranks send their buffer twice more than the others (as in MPICH's
non-power-of-two allreduce).

**Hierarchical** (``local_size = m > 1``; ranks node-major, as ``torchrun`` assigns them):
the ``m`` ranks of a node average their tensors with a reduce-scatter (each keeps ``1/m`` of
the buffer), Adasum runs across nodes on those shards (the tree above over nodes, dot/norm
sums also added over the node's ranks), and an allgather inside the node restores the full
buffer. The result is the Adasum tree over the nodes' means. It needs at least two nodes: on
one node it would be plain averaging, so that raises instead of silently averaging.

Tensors are fused into buckets (``bucket_cap_mb``) per dtype and device, so thousands of
small tensors cost a handful of messages. A bucket is one range of elements to the exchange,
not one copy: large tensors are sent, combined and gathered in their own memory, the small
ones packed into one buffer. fp32, fp64, fp16 and bf16 are supported; fp16 and bf16 travel
as they are and combine in fp32, dots and norms always in fp64. On CPU, fp32 and fp64 go
through small C kernels compiled on first use (:mod:`.native`; the same bits on every
instruction set), the others through torch kernels (:mod:`.kernels`).

Two ways to use it with the :class:`~trainers.Trainer`, both through
:class:`AdasumCombiner` (``--grad-combine adasum``, ``mode`` below):

* ``delta`` (the default; Horovod's ``DistributedOptimizer(op=Adasum)``, for every
  optimizer): every rank steps its own optimizer on its local gradients from the common
  weights, the updates ``w_new - w_start`` are Adasum-combined and applied.
* ``gradient``: the gradients are Adasum-combined, then one ordinary step. Not Horovod's
  optimizer path; it equals delta mode only for plain SGD without momentum and without
  weight decay (Adasum is scale-equivariant, not additive), and differs with momentum,
  weight decay, Nesterov or any adaptive optimizer. ``auto`` picks gradient mode for
  ``torch.optim.SGD`` and delta mode otherwise (this library's earlier default).

With one rank both are exactly the plain optimizer. Use the single-worker learning rate: no
linear scaling with the number of workers (Adasum of parallel updates is their mean, of
orthogonal ones their sum).

Layout: :mod:`.rule` (the pairwise rule, the reference), :mod:`.kernels` (per-tensor dots and
axpby on a slice of a fused buffer), :mod:`.native` (the same in C, for fp32 and fp64 on
CPU), :mod:`.allreduce` (plans, the tree, buckets),
:mod:`.combiners` (the registered combiner).
"""

from .allreduce import DEFAULT_BUCKET_CAP_MB, adasum_allreduce_
from .combiners import ADASUM_MODES, AdasumCombiner, AdasumOptions, resolve_adasum_mode
from .rule import EPS, adasum_pair

__all__ = [
    "ADASUM_MODES",
    "DEFAULT_BUCKET_CAP_MB",
    "EPS",
    "AdasumCombiner",
    "AdasumOptions",
    "adasum_allreduce_",
    "adasum_pair",
    "resolve_adasum_mode",
]
