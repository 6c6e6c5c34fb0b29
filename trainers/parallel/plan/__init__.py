"""The placement planner: tensor/pipeline/data-parallel degrees, stage boundaries, micro-batches
and schedule for a zoo model on a hierarchical network, under a per-device memory limit.

NEST's idea (network-, compute- and memory-aware device placement by dynamic programming,
Wang et al.), solved exactly without an ILP solver: every ``(tp, pp, dp, M, schedule)`` with
``tp * pp * dp = devices`` is enumerated, and for each an exact chain DP over the model's
blocks (those of :func:`trainers.parallel.pipeline.model_blocks`) finds the contiguous stage
boundaries with the smallest predicted step time whose stages all fit in memory.

Usage::

    python -m trainers.parallel.plan --model bert_24_1024_16 --seq-len 128 \\
        --global-batch 256 --devices 16 --memory-gb 16 --network "8:2400:3e-6,2:200:1e-5" \\
        [--save-profile prof.json | --profile prof.json] [--top 5] [--json plan.json]

    profile = profile_model("bert_24_1024_16", seq_len=128)
    best = plan(profile, Network.parse("8:2400:3e-6,2:200:1e-5"), global_batch=256,
                memory_bytes=16 * 2**30)
    best.flags()   # {"tensor_parallel": ..., "pipeline_parallel": ..., "micro_batches": ...,
                   #  "schedule": ..., "boundaries": [...]}

**Profile** (:func:`profile_model`, on the machine at hand). Every block ``k`` of the chain is
run forward and backward at a profiling micro-batch ``b0`` (``warmup`` runs, then the median
of ``repeats``): forward seconds ``F_k``, backward seconds ``B_k`` (including the gradient of
the block's input, as in a pipeline), the bytes autograd saves for the backward ``a_k``
(counted with ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters
excluded), the bytes of its outputs ``o_k`` (what a stage sends on), its parameter bytes
``w_k``, one AdamW step over its parameters ``O_k`` and the copies data parallelism adds
around the all-reduce of its gradients ``C_k`` (into a flat bucket, the division, back), both
timed after evicting the caches, as in a step. The times are measured again at a
smaller micro-batch ``b1`` (default 2) to fit a fixed per-call part ``F0_k, B0_k`` (Python and
kernel-launch overhead, and the lower efficiency of small matrix products), and optionally at
larger micro-batches (``larger_batches``; ``batch_times``): above ``b0`` the time is then
piecewise linear through the measured batches instead of the line (the time per sample grows
once the activations leave the caches).
For a Transformer layer it also records the bytes of the tensors tensor parallelism shards
``w^tp_k`` (the column-parallel ``qkv`` and ``fc1`` weights and biases, the row-parallel
``proj`` and ``fc2`` weights: the layout of :func:`trainers.parallel.parallelize_bert`), the
part of ``a_k`` that shards, ``a^tp_k`` (from the saved bytes of a copy of the layer cut to
``1/t`` of its heads and hidden units), and the bytes of one Megatron all-reduce
``r_k = o_k`` (the ``(b, T, C)`` hidden states). Blocks that are structurally identical with
identically shaped inputs (BERT's layers, ResNeSt's repeated bottlenecks) are measured once.

**Scaling assumption.** At micro-batch ``b``::

    F_k(b) = F0_k + (F_k - F0_k) b / b0        (B_k likewise: affine in b)
    a_k(b) = a_k b / b0,  o_k(b) = o_k b / b0,  r_k(b) = r_k b / b0      (linear in b)

**Network.** Levels innermost first, ``size:gbps:latency_s`` each; the product of the sizes is
the number of devices and level ``l`` groups ``size_0 * ... * size_l`` consecutive ranks.
Ranks are laid out as Megatron-LM does, tensor parallel innermost:
``rank = d * (tp * pp) + p * tp + t``. A collective over a group, or a message between two
ranks, runs at the bandwidth ``W_l`` (bytes/s) and latency ``alpha_l`` of the outermost level
its members span (the slowest); every group of a kind is taken at its slowest instance.
Bandwidth is per device: concurrent groups on one level do not share it. With ``S`` bytes::

    AR_N(S)  = 2 (N - 1) / N * S / W_l + 2 (N - 1) alpha_l    (ring all-reduce over N ranks,
                                                               scripts/scaling_whatif.py)
    P2P(S)   = S / W_l + alpha_l                               (one message)

A level may also carry a ring step's measured time per chunk size
(``size:gbps:latency_s:CHUNK@SECONDS/...``, :attr:`Level.hops`): ``AR_N(S)`` is then
``2 (N - 1)`` steps of that curve read at ``S / N`` (linear between the measured chunks).

**Tensor parallelism** (degree ``tp``, only blocks marked ``tensor_parallel``: BERT's layers;
embeddings and heads are replicated, as in :mod:`trainers.parallel.tensor`)::

    F'_k = rho_k(tp) F_k(b) + 2 AR_tp(r_k(b)),   B'_k = rho_k(tp) B_k(b) + 2 AR_tp(r_k(b))
    w'_k = w_k - w^tp_k + w^tp_k / tp,      a'_k = a_k(b) - a^tp_k(b) + a^tp_k(b) / tp

where ``rho_k(tp)`` is the measured time of one rank's share of the layer (its heads and
feed-forward units at the profile's micro-batch) over the whole layer's: more than ``1 / tp``
where the smaller matrix products run less efficiently and DTensor's per-operation cost
weighs, and ``1 / tp`` for a profile that does not list the degree. A profile whose block
lists the degree in ``tp_times`` (the layer really sharded, timed at two batches:
:mod:`._tp_probe`) gives ``rho_k(tp) F_k(b)`` as ``F0^tp_k + (F^tp_k - F0^tp_k) b / b0``
instead, and likewise the backward
(two all-reduces forward, after the attention output and the second feed-forward linear,
and two backward, for the input gradients of ``qkv`` and ``fc1``). Other blocks: ``F'_k =
F_k(b)``, ``w'_k = w_k``, ... The optimizer step scales with the local parameters,
``O'_k = O_k w'_k / w_k``, and so do the bucket copies, ``C'_k = C_k w'_k / w_k`` (0 when
``dp = 1``).

**Pipeline** (``S = pp`` stages, stage ``s`` holds blocks ``beta_s .. beta_{s+1} - 1``, ``M``
micro-batches of ``b = G / (dp M)`` samples, ``G`` the global batch). Per micro-batch, a
stage's forward includes receiving its input and its backward receiving its output's
gradient (the same size)::

    f_s = sum_k F'_k + [s > 0] P2P(o_{beta_s - 1}(b))
    g_s = sum_k B'_k + [s < S - 1] P2P(o_{beta_{s+1} - 1}(b))
    u_s = f_s + g_s

    T_pipe = sum_s u_s + (M - 1) (max_s f_s + max_s g_s)

For GPipe (all forwards, then all backwards) this is exact: it is the makespan of two flow
shops of ``M`` identical jobs, checked against an event simulation of the schedule in the
tests. With ``f_s`` and ``g_s`` in proportion it is the familiar ``(M - 1) max_s t_s + sum_s
t_s``. For 1F1B (PyTorch's ``Schedule1F1B``: ``min(M, S - s)`` warm-up forwards on stage
``s``, then one backward, one forward) the same value is an upper bound, equal for balanced
stages; the event simulation shows 1F1B never slower than GPipe and, on strongly unbalanced
random stages, up to about 30 % faster. So the two schedules are predicted equally fast and
differ in memory; PyTorch's 1F1B needs ``M >= S``. The search therefore considers GPipe only
where 1F1B is not allowed (``M < S``) or not asked for: elsewhere 1F1B has the same predicted
time with the same boundaries and never holds more activations.

**Ranks sharing cores.** Where a machine runs more ranks than it has cores (a rehearsal on
one host or on the lab network, ``r = ranks_per_core`` = ranks / cores > 1) and the profile
was taken with every rank busy at once, the profile's times are those of a rank with ``1/r``
of a core. While ``k`` of the ``S`` stages compute, their ranks get up to a core each and
run in ``phi_k = max(1/r, k/S)`` of the profiled time; the ramp up and down of the schedule
has two slots with ``k`` stages busy for each ``k = 1 .. S - 1``, so the bubble's part
``sum_s u_s - max_s f_s - max_s g_s`` is multiplied by ``c = 2 mean_k phi_k - 1``
(:func:`~.predict.bubble_factor`; ``c = 1`` for ``r <= 1`` or ``S = 1``). The bubble's
communication (tensor-parallel all-reduces and receives, ``comm_s`` per stage and
micro-batch) runs at the link's speed and is not sped up. With balanced stages this is the
makespan of a processor-sharing simulation of GPipe, and of 1F1B without communication; with
communication it bounds 1F1B from above (a stage computes faster while another talks)::

    T_pipe = M (max_s f_s + max_s g_s) + c (sum_s u_s - max_s f_s - max_s g_s)
             + (1 - c) (S - 1) / S sum_s comm_s

**Data parallelism and the update.** After the pipeline, each stage's ``dp`` replicas
all-reduce its gradients (fp32, the local parameter bytes ``W_s = sum_k w'_k``) and step the
optimizer; with an overlap fraction ``o`` (default 0: the gradient all-reduce starts after the
backward, as ``trainers.parallel``'s data-parallel averaging does)::

    E_s = max(0, AR_dp(W_s) - o M sum_k B'_k) + sum_k C'_k + sum_k O'_k

    T_step = T_pipe + max_s E_s

**Memory** per device on stage ``s``, with ``phi`` the optimizer-state factor (default 4:
weights, gradients and Adam's two moments) and ``n_s`` micro-batches of activations held
(GPipe ``M``; 1F1B ``min(M, S - s)``)::

    mem_s = phi W_s + n_s sum_k a'_k(b)         mem = max_s mem_s <= limit

**Search.** For each ``(tp, pp, dp, M, schedule)`` the boundaries minimise ``T_step`` exactly:
a DP over (stage, first ``i`` blocks) keeps every Pareto-optimal label ``(sum w, max f, max g,
max E)``, ``w_s = c u_s + (1 - c) (S - 1) / S comm_s`` (``u_s`` when no cores are shared; the
objective grows with each), drops stages over the memory limit, and prunes
labels whose lower bound (remaining compute added, remaining single blocks in the maxima)
cannot reach the ``k`` best plans found so far. :func:`brute_force` enumerates every split
instead (for the tests). Plans are ranked by ``T_step``, then memory.

**Limits.** Profiles from this CPU stand in for an accelerator's times: ``--compute-scale`` or
``--device-tflops`` scales them uniformly, which keeps the CPU's relative costs of the blocks
(an accelerator's attention, LayerNorm and GEMM ratios differ). Activations are counted at
the profile's dtype (fp32 here; mixed precision roughly halves them). Compute does not
overlap communication except as ``o`` says; all-reduces in one level do not contend for
links; the pipeline's warm-up of the data loader, the loss and gradient clipping are not
modelled. ``--runtime-only`` leaves out what ``trainers.parallel`` cannot run: tensor
parallelism of a model without splittable blocks (ResNeSt). ``benchmarks/plan_check.py``
measures the error on this machine.
"""

from trainers.parallel.plan.cli import main
from trainers.parallel.plan.network import Level, Network, allreduce_time, p2p_time
from trainers.parallel.plan.predict import (
    DEFAULT_OPTIMIZER_STATE_FACTOR,  # noqa: F401 (a constant of the one-file planner, kept here)
    PLAN_FORMAT,  # noqa: F401
    SCHEDULES,  # noqa: F401
    InfeasiblePlanError,
    ParallelConfig,
    Plan,
    Prediction,
    load_plan,
    predict_step_time,
    save_plan,
)
from trainers.parallel.plan.profile import (
    PROFILE_FORMAT,  # noqa: F401
    BlockProfile,
    Profile,
    load_profile,
    save_profile,
)
from trainers.parallel.plan.profiling import profile_model
from trainers.parallel.plan.search import (
    DEFAULT_MAX_MICRO_BATCHES,  # noqa: F401
    brute_force,
    plan,
    top_plans,
)

__all__ = [
    "BlockProfile",
    "InfeasiblePlanError",
    "Level",
    "Network",
    "ParallelConfig",
    "Plan",
    "Prediction",
    "Profile",
    "allreduce_time",
    "brute_force",
    "load_plan",
    "load_profile",
    "main",
    "p2p_time",
    "plan",
    "predict_step_time",
    "profile_model",
    "save_plan",
    "save_profile",
    "top_plans",
]
