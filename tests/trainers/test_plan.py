"""The placement planner (``trainers.parallel.plan``) against independent references.

- the chain DP equals brute force over every boundary split, on random small instances;
- faster links never give a slower best plan;
- the memory limit holds, recomputed here from the profile by hand, and a tight one forces
  pipeline or tensor splits; nothing feasible is a clear error with the least memory needed;
- the ring all-reduce equals ``scripts/scaling_whatif.py``'s ``comm_time``;
- the pipeline step time equals an event simulation of PyTorch's GPipe schedule (exactly)
  and bounds that of its 1F1B schedule (equal when the stages are balanced), and the
  simulation's live micro-batches per stage are the planner's;
- a real tiny BERT's profile: parameter bytes per block sum to the model's, the sharded
  bytes are Megatron's count, saved activations are positive and linear in the batch;
- plan and profile JSON round trips, validation errors naming the file and field, atomic
  writes; the command line.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.parallel import plan as planner
from trainers.parallel.plan import (
    BlockProfile,
    InfeasiblePlanError,
    Network,
    ParallelConfig,
    Profile,
    brute_force,
    load_plan,
    load_profile,
    plan,
    predict_step_time,
    profile_model,
    save_plan,
    save_profile,
    top_plans,
)

ROOT = Path(__file__).resolve().parents[2]


# ---- instances ----------------------------------------------------------------------------------


def random_profile(rng: random.Random, n: int, *, batch: int = 4) -> Profile:
    """A chain of ``n`` blocks: an embedding-like first block, Transformer-like middle blocks
    (tensor-parallel), a small head; random costs."""
    blocks = []
    for k in range(n):
        middle = 0 < k < n - 1
        forward = rng.uniform(0.01, 0.1)
        params = rng.uniform(1e6, 2e8)
        acts = rng.uniform(1e6, 8e7)
        blocks.append(
            BlockProfile(
                name=f"b{k}",
                forward_s=forward,
                backward_s=forward * rng.uniform(1.0, 3.0),
                forward_fixed_s=forward * rng.uniform(0.0, 0.3),
                activation_bytes=acts,
                output_bytes=rng.uniform(1e5, 2e7),
                param_bytes=params,
                optimizer_s=rng.uniform(0.0, 0.01),
                tensor_parallel=middle,
                tp_param_bytes=params * 0.95 if middle else 0.0,
                tp_activation_bytes=acts * 0.7 if middle else 0.0,
                tp_allreduce_bytes=rng.uniform(1e5, 2e7) if middle else 0.0,
            )
        )
    return Profile(
        model="toy", batch=batch, blocks=tuple(blocks), seq_len=16,
        tensor_parallel_degrees=(1, 2, 4, 8),
    )  # fmt: skip


def random_network(rng: random.Random, devices: int) -> Network:
    sizes = {2: [2], 3: [3], 4: [2, 2], 6: [2, 3], 8: [2, 4]}[devices]
    levels = [f"{s}:{rng.choice([10, 100, 1000])}:{rng.choice([1e-5, 1e-4, 1e-3])}" for s in sizes]
    return Network.parse(",".join(levels), devices=devices)


def instance(seed: int) -> tuple[Profile, Network, dict]:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(4, 8))
    network = random_network(rng, rng.choice([2, 3, 4, 6, 8]))
    options = {
        "global_batch": rng.choice([8, 12, 16, 24]),
        "memory_bytes": rng.uniform(3e8, 4e9),
        "overlap": rng.choice([0.0, 0.5]),
        "ranks_per_core": rng.choice([1.0, 1.0, 2.0, 3.0]),
    }
    return profile, network, options


def best(search, profile, network, **options) -> tuple[str, float]:
    try:
        return "ok", search(profile, network, **options)[0].predicted_step_s
    except InfeasiblePlanError as exc:
        return "infeasible", exc.min_memory_bytes


# ---- search ------------------------------------------------------------------------------------


def test_planner_equals_brute_force_on_random_instances():
    outcomes = []
    for seed in range(40):
        profile, network, options = instance(seed)
        fast = best(top_plans, profile, network, k=3, **options)
        slow = best(brute_force, profile, network, k=3, **options)
        assert fast[0] == slow[0], (seed, fast, slow)
        assert math.isclose(fast[1], slow[1], rel_tol=1e-9), (seed, fast, slow)
        if fast[0] == "ok":  # the three best, too
            a = top_plans(profile, network, k=3, **options)
            b = brute_force(profile, network, k=3, **options)
            assert [p.predicted_step_s for p in a] == pytest.approx(
                [p.predicted_step_s for p in b], rel=1e-9
            ), seed
        outcomes.append(fast[0])
    # both outcomes are exercised, and splits other than dp-only win on some
    assert outcomes.count("ok") >= 15 and outcomes.count("infeasible") >= 3


def test_faster_links_never_give_a_slower_best_plan():
    checked = 0
    for seed in range(30):
        profile, network, options = instance(seed)
        status, base = best(top_plans, profile, network, k=1, **options)
        if status != "ok":
            continue
        for level in range(len(network.levels)):
            for change in ({"gbps": 2.0}, {"gbps": 10.0}, {"latency": 0.5}, {"latency": 0.0}):
                faster = plan(profile, network.scaled(level, **change), **options)
                assert faster.predicted_step_s <= base * (1 + 1e-12), (seed, level, change)
                checked += 1
    assert checked >= 40


def stage_memory_by_hand(profile: Profile, p) -> list[float]:
    """phi W_s + n_s A_s(b), from the profile, written out here."""
    b = p.global_batch // (p.data_parallel * p.micro_batches)
    ratio, tp = b / profile.batch, p.tensor_parallel
    out = []
    for s in range(p.pipeline_parallel):
        weights = acts = 0.0
        for blk in profile.blocks[p.boundaries[s] : p.boundaries[s + 1]]:
            w, a = blk.param_bytes, blk.activation_bytes * ratio
            if blk.tensor_parallel:
                w = w - blk.tp_param_bytes + blk.tp_param_bytes / tp
                a = a - blk.tp_activation_bytes * ratio + blk.tp_activation_bytes * ratio / tp
            weights += w
            acts += a
        held = p.micro_batches if p.schedule == "gpipe" else min(p.micro_batches, p.pipeline_parallel - s)  # fmt: skip
        out.append(p.optimizer_state_factor * weights + held * acts)
    return out


def test_memory_limit_is_respected_and_a_tight_one_forces_model_splits():
    for seed in range(25):
        profile, network, options = instance(seed)
        try:
            plans = top_plans(profile, network, k=5, **options)
        except InfeasiblePlanError:
            continue
        for p in plans:
            by_hand = stage_memory_by_hand(profile, p)
            assert max(by_hand) <= options["memory_bytes"]
            assert p.memory_per_device_bytes == pytest.approx(max(by_hand), rel=1e-12)
    # four 1 GB blocks: dp-only needs 4 x 4 GB of weights and state, more than 9 GB
    blocks = tuple(
        BlockProfile(
            name=f"b{k}",
            forward_s=0.1,
            backward_s=0.2,
            activation_bytes=1e7,
            output_bytes=1e6,
            param_bytes=1e9,
            tensor_parallel=0 < k < 3,
            tp_param_bytes=1e9 if 0 < k < 3 else 0.0,
        )  # fmt: skip
        for k in range(4)
    )
    heavy = Profile("heavy", 1, blocks, seq_len=8, tensor_parallel_degrees=(1, 2))
    network = Network.parse("2:1000:1e-6,2:1000:1e-6")
    free = plan(heavy, network, global_batch=8, memory_bytes=math.inf)
    assert (free.tensor_parallel, free.pipeline_parallel) == (1, 1)  # dp-only is fastest
    tight = plan(heavy, network, global_batch=8, memory_bytes=9e9)
    assert tight.pipeline_parallel > 1 or tight.tensor_parallel > 1
    assert max(stage_memory_by_hand(heavy, tight)) <= 9e9
    with pytest.raises(InfeasiblePlanError) as info:
        plan(heavy, network, global_batch=8, memory_bytes=2e9)
    least = info.value.min_memory_bytes
    assert "smallest memory" in str(info.value) and least > 2e9
    # the stated least memory is exact: it fits, and a little less does not
    assert plan(heavy, network, global_batch=8, memory_bytes=least).memory_per_device_bytes <= least
    with pytest.raises(InfeasiblePlanError):
        plan(heavy, network, global_batch=8, memory_bytes=least * 0.999)


# ---- formulas ----------------------------------------------------------------------------------


def _whatif():
    spec = importlib.util.spec_from_file_location("whatif_for_plan", ROOT / "scripts" / "scaling_whatif.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_allreduce_equals_scaling_whatif_comm_time():
    whatif = _whatif()
    for n in (1, 2, 3, 8, 64):
        for gbps, latency in ((10.0, 1e-5), (400.0, 5e-6), (2400.0, 0.0)):
            for size in (0.0, 1e3, 4e8):
                w = whatif.Workload(compute_time=1.0, grad_bytes=size)
                expected = whatif.comm_time(w, n, gbps, latency)
                assert planner.allreduce_time(size, n, gbps, latency) == pytest.approx(expected, rel=1e-12)  # fmt: skip
    # the planner's data-parallel all-reduce of each stage's gradient: one level, 4 replicas
    rng = random.Random(0)
    profile = random_profile(rng, 5)
    network = Network.parse("4:25:2e-5")
    config = ParallelConfig(1, 1, 4, 1, "1f1b", (0, 5))
    pred = predict_step_time(profile, network, config, global_batch=8)
    grad = sum(b.param_bytes for b in profile.blocks)
    expected = whatif.comm_time(whatif.Workload(compute_time=1.0, grad_bytes=grad), 4, 25.0, 2e-5)
    assert pred.breakdown["stages"][0]["dp_allreduce_s"] == pytest.approx(expected, rel=1e-12)


def test_a_measured_hop_curve_prices_the_ring_steps():
    """A level's measured ring-step times (``CHUNK@SECONDS/...``): a curve sampled from the
    ring formula's own line gives the formula's all-reduce at every size (interpolated and
    extrapolated); a bent curve is read at ``S / N`` per step, between and beyond its points;
    the stage's all-reduce in a plan uses it; the string round-trips and bad curves are
    refused naming the item."""
    gbps, latency = 10.0, 1e-4
    line = [(c, c / (gbps * 1e9 / 8) + latency) for c in (1.0, 1e4, 1e6, 4e6)]
    text = "4:10:0.0001:" + "/".join(f"{c:g}@{t!r}" for c, t in line)
    level = Network.parse(text).levels[0]
    for n in (2, 3, 4):
        for size in (4.0, 3e4, 2e6, 1e8):  # below, between and beyond the chunks
            want = planner.allreduce_time(size, n, gbps, latency)
            if size / n < 1.0:  # below the first chunk: its time (no negative bytes)
                want = 2 * (n - 1) * line[0][1]
            assert level.allreduce_time(size, n) == pytest.approx(want, rel=1e-9)
    bent = Network.parse("4:10:0.0001:0@0.001/1000@0.002/3000@0.010").levels[0]
    assert bent.hop_time(500.0) == pytest.approx(0.0015)
    assert bent.hop_time(2000.0) == pytest.approx(0.006)
    assert bent.hop_time(5000.0) == pytest.approx(0.018)  # the last slope, 4 us per byte
    assert bent.allreduce_time(8000.0, 4) == pytest.approx(6 * 0.006)
    assert bent.allreduce_time(8000.0, 1) == 0.0
    assert str(Network.parse(str(Network((bent,))))) == str(Network((bent,)))
    faster = Network((bent,)).scaled(0, gbps=2.0, latency=0.5).levels[0]
    for chunk in (0.0, 500.0, 3000.0, 9000.0):
        assert faster.hop_time(chunk) < bent.hop_time(chunk)
    # in a plan: the data-parallel all-reduce of the stage's gradients
    rng = random.Random(0)
    profile = random_profile(rng, 5)
    config = ParallelConfig(1, 1, 4, 1, "1f1b", (0, 5))
    grad = sum(b.param_bytes for b in profile.blocks)
    pred = predict_step_time(profile, Network((bent,)), config, global_batch=8)
    assert pred.breakdown["stages"][0]["dp_allreduce_s"] == pytest.approx(
        bent.allreduce_time(grad, 4), rel=1e-12
    )
    for bad, words in (
        ("4:10:1e-4:100@0.1/100@0.2", "must grow strictly"),
        ("4:10:1e-4:100@0", "seconds > 0"),
        ("4:10:1e-4:100-0.1", "100-0.1.*CHUNK_BYTES@SECONDS"),
        ("4:10:1e-4:1@1:2", "size:gbps:latency_s"),
    ):
        with pytest.raises(ValueError, match=words):
            Network.parse(bad)


def test_groups_run_at_the_slowest_level_they_span_in_megatron_rank_order():
    # rank = d * tp * pp + p * tp + t; levels of 2 devices, then 2 pairs, then 2 quads
    network = Network.parse("2:1000:1e-6,2:100:1e-5,2:10:1e-4")
    profile = random_profile(random.Random(2), 6)
    config = ParallelConfig(2, 2, 2, 2, "1f1b", (0, 3, 6))
    pred = predict_step_time(profile, network, config, global_batch=8)
    # tp pairs {0,1}: level 0; pipeline hops {0,2}: level 1; dp pairs {0,4}: level 2
    assert pred.breakdown["levels"] == {"tensor_parallel": 0, "data_parallel": 2, "pipeline": [1]}
    ratio = 2 / profile.batch  # micro-batch 8 / (2 replicas x 2 micro-batches)
    first = pred.breakdown["stages"][0]
    expected_tp = sum(
        4 * planner.allreduce_time(b.tp_allreduce_bytes * ratio, 2, 1000.0, 1e-6)
        for b in profile.blocks[0:3]
        if b.tensor_parallel
    )
    assert first["tp_allreduce_s"] == pytest.approx(expected_tp, rel=1e-12)
    hop = profile.blocks[2].output_bytes * ratio / (100e9 / 8) + 1e-5  # its output's gradient
    assert first["p2p_s"] == pytest.approx(hop, rel=1e-12)
    weights = first["param_bytes"]
    assert first["dp_allreduce_s"] == pytest.approx(
        planner.allreduce_time(weights, 2, 10.0, 1e-4), rel=1e-12
    )
    # the slowest instance: with 3 devices per node, tp pair {2, 3} crosses nodes
    odd = Network.parse("3:1000:1e-6,2:10:1e-4")
    pred = predict_step_time(profile, odd, ParallelConfig(2, 1, 3, 1, "1f1b", (0, 6)), global_batch=6)  # fmt: skip
    assert pred.breakdown["levels"]["tensor_parallel"] == 1
    assert pred.breakdown["levels"]["data_parallel"] == 1


def schedule_order(schedule: str, s: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The op order of stage ``s`` in PyTorch's ScheduleGPipe / Schedule1F1B."""
    if schedule == "gpipe":
        return [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]
    warmup = min(micro, stages - s)
    ops = [("F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while True:
        ops.append(("B", backward))
        backward += 1
        if forward == micro:
            break
        ops.append(("F", forward))
        forward += 1
    ops += [("B", m) for m in range(backward, micro)]
    return ops


def simulate(schedule: str, f: list[float], g: list[float], micro: int) -> tuple[float, list[int]]:
    """Makespan and the most micro-batches alive (forward done, backward not) per stage, of
    stages that run their ops in order; a forward waits for the previous stage's forward of
    the same micro-batch, a backward for the next stage's backward (the last stage: its own
    forward)."""
    stages = len(f)
    orders = [schedule_order(schedule, s, stages, micro) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * stages, [0] * stages
    alive, peak = [0] * stages, [0] * stages
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while pos[s] < len(orders[s]):
                kind, m = orders[s][pos[s]]
                if kind == "F":
                    dep = ("F", s - 1, m) if s > 0 else None
                else:
                    dep = ("B", s + 1, m) if s < stages - 1 else ("F", s, m)
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep else 0.0)
                clock[s] = start + (f[s] if kind == "F" else g[s])
                done[(kind, s, m)] = clock[s]
                alive[s] += 1 if kind == "F" else -1
                peak[s] = max(peak[s], alive[s])
                pos[s] += 1
                progress = True
    assert all(pos[s] == len(orders[s]) for s in range(stages)), "deadlock"
    return max(clock), peak


def simulate_shared(schedule: str, f: list[float], g: list[float], micro: int,
                    ranks_per_core: float, comm: tuple[list[float], list[float]] | None = None,
                    ) -> float:  # fmt: skip
    """Makespan of the schedule on ranks that share cores, ``ranks_per_core`` to a core,
    ``f`` and ``g`` timed with every rank busy: while ``k`` of the ``S`` stages compute, each
    progresses at ``1 / max(1 / ranks_per_core, k / S)`` of its work per second (processor
    sharing; 1 when the ranks have a core each). ``comm``: per stage, the part of ``f`` and of
    ``g`` spent communicating, first, at its own speed and leaving the core to the others.
    Event by event: start what may start, run to the next part that ends."""
    stages = len(f)
    fc, gc = comm if comm is not None else ([0.0] * stages, [0.0] * stages)
    orders = [schedule_order(schedule, s, stages, micro) for s in range(stages)]
    done: set[tuple[str, int, int]] = set()
    pos, running = [0] * stages, [None] * stages
    now = 0.0
    while True:
        for s in range(stages):
            if running[s] is None and pos[s] < len(orders[s]):
                kind, m = orders[s][pos[s]]
                if kind == "F":
                    dep = ("F", s - 1, m) if s > 0 else None
                else:
                    dep = ("B", s + 1, m) if s < stages - 1 else ("F", s, m)
                if dep is None or dep in done:
                    talk = fc[s] if kind == "F" else gc[s]
                    work = (f[s] if kind == "F" else g[s]) - talk
                    running[s] = [kind, m, talk, work]  # seconds of comm, profiled compute
                    pos[s] += 1
        active = [s for s in range(stages) if running[s] is not None]
        if not active:
            break
        busy = [s for s in active if running[s][2] <= 0.0]  # computing, not communicating
        slow = max(1 / ranks_per_core, len(busy) / stages) if ranks_per_core > 1 else 1.0
        step = min([running[s][2] for s in active if running[s][2] > 0.0]
                   + [running[s][3] * slow for s in busy])  # fmt: skip
        now += step
        for s in active:
            if running[s][2] > 0.0:
                left = running[s][2] - step
                running[s][2] = left if left > 1e-15 else 0.0
            else:
                running[s][3] -= step / slow
            if running[s][2] <= 0.0 and running[s][3] <= 1e-15:
                done.add((running[s][0], s, running[s][1]))
                running[s] = None
    assert all(pos[s] == len(orders[s]) for s in range(stages)), "deadlock"
    return now


def _pipeline_case(rng: random.Random, n: int, stages: int, balanced: bool):
    """A profile at the micro-batch itself (no scaling), one network level, dp 1."""
    fwd = [rng.uniform(0.01, 0.1) for _ in range(n)]
    bwd = [x * rng.uniform(1.0, 3.0) for x in fwd]
    out = [rng.uniform(1e5, 1e7) for _ in range(n)]
    gbps, latency = rng.choice([1.0, 10.0, 100.0]), rng.choice([0.0, 1e-4, 1e-3])
    if balanced:  # equal stages: equal blocks, no transfers (they would add to the end stages)
        fwd, bwd, out, latency = [fwd[0]] * n, [bwd[0]] * n, [0.0] * n, 0.0
    blocks = tuple(
        BlockProfile(
            name=f"b{k}",
            forward_s=fwd[k],
            backward_s=bwd[k],
            activation_bytes=1.0,
            output_bytes=out[k],
            param_bytes=1.0,
        )  # fmt: skip
        for k in range(n)
    )
    network = Network.parse(f"{stages}:{gbps}:{latency}")
    if balanced:
        per = n // stages
        bounds = tuple(range(0, n + 1, per))
    else:
        bounds = (0, *sorted(rng.sample(range(1, n), stages - 1)), n)
    # per stage and micro-batch: the blocks' time plus receiving (input forward, output
    # gradient backward) at S / B + a
    rate = gbps * 1e9 / 8
    f, g = [], []
    for s in range(stages):
        i, j = bounds[s], bounds[s + 1]
        f.append(sum(fwd[i:j]) + (out[i - 1] / rate + latency if s > 0 else 0.0))
        g.append(sum(bwd[i:j]) + (out[j - 1] / rate + latency if s < stages - 1 else 0.0))
    return Profile("pipe", 1, blocks, seq_len=4), network, bounds, f, g


@pytest.mark.parametrize("balanced", [False, True], ids=["random", "balanced"])
def test_pipeline_time_against_an_event_simulation_of_the_schedules(balanced):
    rng = random.Random(1 if balanced else 0)
    worst_gap = 0.0
    for _ in range(60):
        stages = rng.choice([2, 3, 4])
        n = stages * rng.randint(1, 3) if balanced else rng.randint(stages, 8)
        profile, network, bounds, f, g = _pipeline_case(rng, n, stages, balanced)
        micro = rng.randint(stages, 9)
        for schedule in ("gpipe", "1f1b"):
            config = ParallelConfig(1, stages, 1, micro, schedule, bounds)
            pred = predict_step_time(profile, network, config, global_batch=micro)
            simulated, peak = simulate(schedule, f, g, micro)
            held = [st["in_flight"] for st in pred.breakdown["stages"]]
            assert held == peak, (schedule, held, peak)
            assert pred.breakdown["update_s"] == 0.0
            if schedule == "gpipe" or balanced:
                assert pred.step_s == pytest.approx(simulated, rel=1e-9), (schedule, f, g, micro)
            else:  # 1F1B: the GPipe value bounds it
                assert simulated <= pred.step_s * (1 + 1e-9)
                worst_gap = max(worst_gap, 1 - simulated / pred.step_s)
    if not balanced:
        assert 0.0 < worst_gap < 0.5  # the bound is not always tight, and not far off


def test_a_bubble_on_shared_cores_against_an_event_simulation():
    """Ranks sharing cores (the profile timed with every rank busy): with balanced stages the
    prediction is the processor-sharing simulation's makespan for both schedules, at 1 to 4
    ranks per core; with tensor-parallel all-reduces in the stages too for GPipe, and an upper
    bound for 1F1B; two stages on half a core each lose nothing to the bubble; at one rank
    per core the prediction is the plain one."""
    rng = random.Random(2)
    for _ in range(40):
        stages = rng.choice([2, 3, 4])
        profile, network, bounds, f, g = _pipeline_case(rng, stages * rng.randint(1, 2),
                                                        stages, True)  # fmt: skip
        micro = rng.randint(stages, 9)
        r = rng.choice([1.0, 1.5, 2.0, 3.0, 4.0])
        for schedule in ("gpipe", "1f1b"):
            config = ParallelConfig(1, stages, 1, micro, schedule, bounds)
            pred = predict_step_time(profile, network, config, global_batch=micro,
                                     ranks_per_core=r)  # fmt: skip
            assert pred.step_s == pytest.approx(simulate_shared(schedule, f, g, micro, r),
                                                rel=1e-9), (schedule, stages, micro, r)  # fmt: skip
            plain = predict_step_time(profile, network, config, global_batch=micro)
            assert (pred.step_s < plain.step_s) == (r > 1)
    # tensor parallelism inside balanced stages: its all-reduces are not sped up
    worst = 0.0
    for _ in range(20):
        stages, micro, r = rng.choice([2, 3, 4]), rng.randint(4, 9), rng.choice([2.0, 3.0])
        micro = max(micro, stages)
        layer = BlockProfile(name="layer", forward_s=rng.uniform(0.01, 0.1),
                             backward_s=rng.uniform(0.02, 0.2), activation_bytes=1.0,
                             output_bytes=0.0, param_bytes=1e6, tensor_parallel=True,
                             tp_param_bytes=8e5, tp_activation_bytes=0.5,
                             tp_allreduce_bytes=rng.uniform(1e5, 1e7))  # fmt: skip
        prof = Profile("tp", micro, (layer,) * stages, seq_len=4, tensor_parallel_degrees=(1, 2))
        net = Network.parse(f"2:{rng.choice([1.0, 10.0])}:0,{stages}:100:0")
        for schedule in ("gpipe", "1f1b"):
            config = ParallelConfig(2, stages, 1, micro, schedule, tuple(range(stages + 1)))
            pred = predict_step_time(prof, net, config, global_batch=micro * micro,
                                     ranks_per_core=r)  # fmt: skip
            per = pred.breakdown["stages"]
            f = [st["forward_s"] for st in per]
            g = [st["backward_s"] for st in per]
            talk = [st["tp_allreduce_s"] / 2 for st in per]  # two all-reduces each way
            assert min(talk) > 0
            simulated = simulate_shared(schedule, f, g, micro, r, (talk, talk))
            if schedule == "gpipe":  # the stages run in step: exact
                assert pred.step_s == pytest.approx(simulated, rel=1e-9), (stages, micro, r)
            else:  # 1F1B's forwards and backwards overlap: one stage's all-reduce frees the
                # core for another's compute, which the formula does not count
                assert simulated <= pred.step_s * (1 + 1e-9)
                worst = max(worst, 1 - simulated / pred.step_s)
    assert 0.0 < worst < 0.2, worst  # 0.147 on these cases
    two = ParallelConfig(1, 2, 1, 4, "1f1b", (0, 1, 2))
    case = _pipeline_case(random.Random(3), 2, 2, True)
    halves = predict_step_time(case[0], case[1], two, global_batch=4, ranks_per_core=2.0)
    assert halves.breakdown["bubble_s"] == 0.0
    assert halves.step_s == pytest.approx(4 * (case[3][0] + case[4][0]), rel=1e-12)
    with pytest.raises(ValueError, match="ranks_per_core must be >= 1"):
        plan(case[0], case[1], global_batch=4, memory_bytes=math.inf, ranks_per_core=0.5)


# ---- profile -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert():
    from modelzoo.nlp.bert import BertConfig, BertForQuestionAnswering

    config = BertConfig(vocab_size=120, hidden_size=32, num_layers=2, num_heads=4,
                        intermediate_size=64, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    return BertForQuestionAnswering(config)


def test_profile_of_a_real_tiny_bert(tiny_bert):
    synced = []
    a = profile_model(tiny_bert, seq_len=16, batch=2, repeats=2, warmup=1, larger_batches=(4,),
                      sync=lambda: synced.append(1))  # fmt: skip
    # the embeddings, layer0 and the head timed at batches 2 and 4 (layer1 is layer0's
    # twin), and the sharded-layer probe of layer0: once its child is ready, once it is done
    assert len(synced) == 3 + 3 + 2
    b = profile_model(tiny_bert, seq_len=16, batch=4, repeats=2, warmup=1)
    with pytest.raises(ValueError, match="must all be above the profiling batch 2"):
        profile_model(tiny_bert, seq_len=16, batch=2, larger_batches=(2, 4))
    assert a.source["batches"] == [2, 4] and b.blocks[0].batch_times == {}
    model_bytes = sum(p.numel() * p.element_size() for p in tiny_bert.parameters())
    assert sum(blk.param_bytes for blk in a.blocks) == model_bytes
    assert [blk.name for blk in a.blocks] == ["embeddings", "layer0", "layer1", "head"]
    assert [blk.tensor_parallel for blk in a.blocks] == [False, True, True, False]
    assert a.tensor_parallel_degrees == (1, 2, 4)  # heads 4, intermediate 64
    c, inner = 32, 64
    # Megatron's shards: qkv and fc1 weight + bias, proj and fc2 weight (4 bytes each)
    sharded = 4 * (3 * c * c + 3 * c + c * c + c * inner + inner + inner * c)
    for x, y in zip(a.blocks, b.blocks, strict=True):
        assert x.activation_bytes > 0 and x.forward_s > 0 and x.backward_s > 0
        assert x.optimizer_s > 0 and x.grad_copy_s > 0  # every block has parameters
        assert set(x.batch_times) == {"4"} and x.batch_times["4"]["backward_s"] > 0
        assert 1.8 <= y.activation_bytes / x.activation_bytes <= 2.2, x.name
        if x.tensor_parallel:
            assert x.tp_param_bytes == sharded
            assert x.tp_allreduce_bytes == 2 * 16 * c * 4  # one (b, T, C) fp32 tensor
            assert 0 < x.tp_activation_bytes < x.activation_bytes
            # the layer really sharded (DTensor on a fake group), timed at degrees 2 and 4
            assert set(x.tp_times) == set(x.tp_time_ratio) == {"2", "4"}, x.tp_time_ratio
            for degree, t in x.tp_times.items():
                assert 0 <= t["forward_fixed_s"] <= t["forward_s"] and t["backward_s"] > 0
                whole = x.forward_s + x.backward_s
                assert x.tp_time_ratio[degree] == pytest.approx(
                    (t["forward_s"] + t["backward_s"]) / whole
                )
        else:
            assert x.tp_time_ratio == {} and x.tp_times == {}
    # the hidden states and the (b, T) int64 mask travel between stages
    assert a.blocks[0].output_bytes == 2 * 16 * c * 4 + 2 * 16 * 8
    # a layer keeps at least its input, qkv output and feed-forward input and hidden units
    assert a.blocks[1].activation_bytes >= 4 * 2 * 16 * (c + 3 * c + c + inner)


def test_profile_json_round_trip_atomic_write_and_validation(tmp_path, tiny_bert):
    profile = profile_model(tiny_bert, seq_len=8, batch=2, repeats=1, warmup=0, name="tiny")
    path = save_profile(profile, tmp_path / "prof.json")
    assert load_profile(path) == profile
    data = json.loads(path.read_text())
    data["blocks"][1]["forward_s"] = -1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json.*blocks\[1\].*'forward_s'"):
        load_profile(bad)
    del data["blocks"][1]["forward_s"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json.*blocks\[1\].*missing field 'forward_s'"):
        load_profile(bad)
    bad.write_text(json.dumps({**json.loads(path.read_text()), "image_size": 32}))
    with pytest.raises(ValueError, match="exactly one of the fields 'seq_len'"):
        load_profile(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: not a readable JSON profile"):
        load_profile(bad)


# ---- plan files --------------------------------------------------------------------------------


def _small_plan():
    profile, network, options = instance(3)
    return profile, network, options, plan(profile, network, **options)


def test_plan_json_round_trip_and_validation_errors(tmp_path):
    profile, network, options, best_plan = _small_plan()
    path = save_plan(best_plan, tmp_path / "plan.json")
    back = load_plan(path)
    assert back == best_plan
    assert back.flags() == {
        "tensor_parallel": best_plan.tensor_parallel,
        "pipeline_parallel": best_plan.pipeline_parallel,
        "micro_batches": best_plan.micro_batches,
        "schedule": best_plan.schedule,
        "boundaries": list(best_plan.boundaries),
    }
    # the file's prediction is the model's for its placement
    again = predict_step_time(profile, network, back.config, global_batch=back.global_batch,
                              overlap=back.overlap, ranks_per_core=back.ranks_per_core)  # fmt: skip
    assert again.step_s == pytest.approx(back.predicted_step_s, rel=1e-12)
    good = json.loads(path.read_text())
    cases = {
        "schedule": ("zigzag", "'schedule' must be one of"),
        "boundaries": ([0, 0], "'boundaries'"),
        "data_parallel": (good["data_parallel"] + 1, "'data_parallel'"),
        "micro_batches": (0, "'micro_batches' must be >= 1"),
        "network": ("3:10:1e-5", "'network'"),
        "format": (2, "'format'"),
        "predicted_step_s": ("fast", "'predicted_step_s' must be a finite number"),
        "tensor_parallel": (True, "'tensor_parallel' must be an integer"),
        "extra": (1, "unknown field"),
    }
    for key, (value, message) in cases.items():
        bad = tmp_path / f"bad_{key}.json"
        bad.write_text(json.dumps({**good, key: value}))
        with pytest.raises(ValueError) as info:
            load_plan(bad)
        assert str(bad) in str(info.value) and message in str(info.value), (key, info.value)
    missing = {k: v for k, v in good.items() if k != "global_batch"}
    (tmp_path / "missing.json").write_text(json.dumps(missing))
    with pytest.raises(ValueError, match="missing field 'global_batch'"):
        load_plan(tmp_path / "missing.json")


def test_plan_write_is_atomic(tmp_path, monkeypatch):
    *_, best_plan = _small_plan()
    path = save_plan(best_plan, tmp_path / "plan.json")
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        save_plan(best_plan, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary left


# ---- command line ------------------------------------------------------------------------------


def test_cli_with_a_profile_file(tmp_path, capsys):
    profile, network, options, expected = _small_plan()
    prof = save_profile(profile, tmp_path / "prof.json")
    out = tmp_path / "plan.json"
    argv = ["--profile", str(prof), "--global-batch", str(options["global_batch"]),
            "--devices", str(network.devices), "--memory-gb", str(options["memory_bytes"] / 2**30),
            "--network", str(network), "--overlap", str(options["overlap"]),
            "--ranks-per-core", str(options["ranks_per_core"]), "--top", "3"]  # fmt: skip
    assert planner.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step s" in printed and "best plan, per stage" in printed
    written = load_plan(out)
    assert written.predicted_step_s == pytest.approx(expected.predicted_step_s, rel=1e-9)
    assert written.config == expected.config
    # errors name the flag and say what to do
    with pytest.raises(SystemExit) as info:
        planner.main([*argv[:-10], "--network", "7:10:1e-5", "--memory-gb", "1"])
    assert info.value.code == 2
    assert "--network" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        planner.main([*argv, "--ranks-per-core", "0.5"])
    assert info.value.code == 2
    assert "--ranks-per-core must be >= 1, got 0.5" in capsys.readouterr().err
    assert planner.main([*argv, "--memory-gb", "1e-6"]) == 2
    assert "smallest memory any needs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        planner.main([*argv, "--micro-batches", "2,x"])
    assert "--micro-batches" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        planner.main([*argv[2:], "--model", "bert_12_768_12", "--profile-batch", "4",
                      "--profile-larger-batches", "4,8"])  # fmt: skip
    assert info.value.code == 2
    assert "--profile-larger-batches [4] must be above --profile-batch 4" in (
        capsys.readouterr().err
    )
    # the module runs as a program
    result = subprocess.run(
        [sys.executable, "-m", "trainers.parallel.plan", *argv], cwd=ROOT, capture_output=True,
        text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "best plan, per stage" in result.stdout


def _plan_file(tmp_path, name: str, **fields) -> Path:
    """A valid plan file (the planner's) with its placement replaced by ``fields``."""
    _, _, _, made = _small_plan()
    data = {**made.to_dict(), "network": f"{fields.get('devices', 4)}:10:1e-5", **fields}
    data["profile"] = {**data["profile"], "blocks": data["boundaries"][-1]}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    load_plan(path)  # a plan the loader takes
    return path


def _args(**given):
    import types

    from trainers.cli import _PLAN_FLAGS

    return types.SimpleNamespace(**{**{name: unset for name, _, unset in _PLAN_FLAGS}, **given})


def test_scripts_plan_flag_sets_the_placement_and_refuses_another_run(tmp_path):
    """``--plan`` (trainers.cli.apply_plan): the plan's degrees, micro-batches, schedule and
    boundaries become the flags; a run of another size, model, batch or sequence length, or a
    flag that contradicts the plan, is refused with a message naming what to change; a model
    of another block count than the profiled one too."""
    import types

    from trainers.cli import apply_plan

    world = types.SimpleNamespace(world_size=4, is_main=False)
    pipe = _plan_file(tmp_path, "pp.json", model="tiny", seq_len=64, devices=4, global_batch=16,
                      tensor_parallel=1, pipeline_parallel=2, data_parallel=2, micro_batches=4,
                      schedule="gpipe", boundaries=[0, 2, 5])  # fmt: skip
    args = _args(plan=str(pipe))
    apply_plan(args, world, model_name="tiny", batch_size=8, accumulate=1, seq_len=64)
    assert (args.tensor_parallel, args.pipeline_parallel, args.micro_batches,
            args.pipeline_schedule, args.pipeline_boundaries) == (1, 2, 4, "gpipe", [0, 2, 5])  # fmt: skip
    # without pipeline stages the plan's micro-batches are accumulation steps
    tp = _plan_file(tmp_path, "tp.json", model="tiny", seq_len=64, devices=4, global_batch=16,
                    tensor_parallel=2, pipeline_parallel=1, data_parallel=2, micro_batches=2,
                    schedule="1f1b", boundaries=[0, 5])  # fmt: skip
    args = _args(plan=str(tp))
    apply_plan(args, world, model_name="tiny", batch_size=4, accumulate=2, seq_len=64)
    assert (args.tensor_parallel, args.pipeline_parallel, args.micro_batches,
            args.pipeline_boundaries) == (2, 1, None, None)  # fmt: skip
    # both at once: stages of tensor-parallel ranks (one replica of 4)
    both = _plan_file(tmp_path, "tppp.json", model="tiny", seq_len=64, devices=4,
                      global_batch=8, tensor_parallel=2, pipeline_parallel=2, data_parallel=1,
                      micro_batches=4, schedule="1f1b", boundaries=[0, 3, 5])  # fmt: skip
    args = _args(plan=str(both))
    apply_plan(args, world, model_name="tiny", batch_size=8, accumulate=1, seq_len=64)
    assert (args.tensor_parallel, args.pipeline_parallel, args.micro_batches,
            args.pipeline_schedule, args.pipeline_boundaries) == (2, 2, 4, "1f1b", [0, 3, 5])  # fmt: skip
    refused = {
        "processes": ({"world": types.SimpleNamespace(world_size=2, is_main=False)}, "4 devices"),
        "model": ({"model_name": "other"}, "'tiny'"),
        "batch": ({"batch_size": 4}, "pass a batch size of 8 and accumulate 1"),
        "accumulation": ({"batch_size": 4, "accumulate": 2}, "batch size of 8 and accumulate 1"),
        "sequence": ({"seq_len": 128}, "--seq-len 128"),
        "flag": ({"given": {"pipeline_schedule": "1f1b"}}, "--pipeline-schedule 1f1b contradicts"),
    }
    for case, (change, message) in refused.items():
        options = {"model_name": "tiny", "batch_size": 8, "accumulate": 1, "seq_len": 64,
                   **change}  # fmt: skip
        run_world = options.pop("world", world)
        args = _args(plan=str(pipe), **options.pop("given", {}))
        with pytest.raises(SystemExit) as info:
            apply_plan(args, run_world, **options)
        assert str(pipe) in str(info.value) and message in str(info.value), (case, info.value)
    # the flag given with the plan's own value is fine
    args = _args(plan=str(pipe), pipeline_parallel=2, micro_batches=4)
    apply_plan(args, world, model_name="tiny", batch_size=8, accumulate=1, seq_len=64)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="bad.json.*missing field"):
        apply_plan(_args(plan=str(bad)), world, model_name=None, batch_size=8, accumulate=1)
    from trainers.cli import _check_plan_blocks

    bert = _tiny_bert_model()
    _check_plan_blocks(str(pipe), bert)  # 5 blocks: embeddings, 3 layers, the head
    with pytest.raises(SystemExit, match="5 blocks; this run's model has 6"):
        _check_plan_blocks(str(pipe), _tiny_bert_model(layers=4))


def _tiny_bert_model(layers: int = 3):
    from modelzoo.nlp.bert import BertConfig, BertForQuestionAnswering

    return BertForQuestionAnswering(BertConfig(vocab_size=50, hidden_size=16, num_layers=layers,
                                               num_heads=2, intermediate_size=32,
                                               max_position_embeddings=16))  # fmt: skip


def test_the_sharded_layers_times_replace_the_share():
    """With ``tp_times`` at a degree, a layer costs those times (their per-call parts as
    they are, the rest scaled with the micro-batch), not ``rho`` times the whole layer's:
    one micro-batch at twice the profile's batch, tp 2, nothing else."""
    import dataclasses

    layer = BlockProfile(name="layer", forward_s=1.0, backward_s=2.0, activation_bytes=1e6,
                         output_bytes=1e5, param_bytes=1e6, tensor_parallel=True,
                         tp_param_bytes=9e5, tp_activation_bytes=5e5, tp_allreduce_bytes=1e5,
                         tp_time_ratio={"2": 0.7})  # fmt: skip
    sharded = {"forward_s": 0.8, "backward_s": 1.1, "forward_fixed_s": 0.3,
               "backward_fixed_s": 0.1}  # fmt: skip
    plain = Profile(model="toy", batch=4, blocks=(layer,), seq_len=16,
                    tensor_parallel_degrees=(1, 2))  # fmt: skip
    timed = dataclasses.replace(
        plain, blocks=(dataclasses.replace(layer, tp_times={"2": sharded}),)
    )
    network = Network.parse("2:1e12:0", devices=2)  # communication free
    config = ParallelConfig(2, 1, 1, 1, "1f1b", (0, 1))
    a, b = (predict_step_time(p, network, config, global_batch=8) for p in (plain, timed))
    # micro-batch 8 = 2 x the profile's 4: per-call parts once, the rest twice
    want = 0.3 + 2 * (0.8 - 0.3) + 0.1 + 2 * (1.1 - 0.1)
    assert b.step_s - b.breakdown["update_s"] == pytest.approx(want, rel=1e-12)
    assert a.step_s - a.breakdown["update_s"] == pytest.approx(0.7 * 2 * 3.0, rel=1e-12)
    # read back from JSON, and refused when malformed
    again = Profile.from_dict(timed.to_dict())
    assert again.blocks[0].tp_times == {"2": sharded}
    for bad, message in [
        ({"1": sharded}, "maps degrees > 1"),
        ({"2": {**sharded, "forward_fixed_s": 0.9}}, "forward_fixed_s .0.9. is larger than"),
        ({"2": {"forward_s": 1.0}}, "maps degrees > 1"),
        ({"2": {**sharded, "backward_s": -1.0}}, "maps degrees > 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            BlockProfile.from_dict(dataclasses.asdict(layer) | {"tp_times": bad}, "prof.json")
    # a faster device: every time scaled, the sharded ones too
    assert timed.scaled(0.5).blocks[0].tp_times["2"]["forward_s"] == pytest.approx(0.4)


def test_bucket_copies_count_with_data_parallelism_only():
    """``E_s = max(0, AR_dp(W_s) - o M B) + sum_k C'_k + sum_k O'_k`` (the package docstring):
    the bucket copies ``C_k`` scale with the local parameters like ``O_k`` (tensor parallelism
    shards them) and cost nothing without data parallelism; ``scaled`` scales them too."""
    import dataclasses

    layer = BlockProfile(name="layer", forward_s=1.0, backward_s=2.0, activation_bytes=1e6,
                         output_bytes=1e5, param_bytes=1e6, optimizer_s=0.4, grad_copy_s=0.2,
                         tensor_parallel=True, tp_param_bytes=6e5, tp_activation_bytes=5e5,
                         tp_allreduce_bytes=1e5)  # fmt: skip
    head = BlockProfile(name="head", forward_s=0.5, backward_s=0.5, activation_bytes=1e5,
                        output_bytes=1e3, param_bytes=1e5, optimizer_s=0.05, grad_copy_s=0.03)  # fmt: skip
    profile = Profile(model="toy", batch=4, blocks=(layer, head), seq_len=16,
                      tensor_parallel_degrees=(1, 2))  # fmt: skip
    free = Network.parse("4:1e12:0", devices=4)  # communication free
    cases = {  # (tp, dp): the update of the one stage
        (1, 4): 0.2 + 0.03 + 0.4 + 0.05,
        (2, 2): (0.2 + 0.4) * (1e6 - 6e5 / 2) / 1e6 + 0.03 + 0.05,
    }
    for (tp, dp), want in cases.items():
        config = ParallelConfig(tp, 1, dp, 1, "1f1b", (0, 2))
        got = predict_step_time(profile, free, config, global_batch=8)
        assert got.breakdown["update_s"] == pytest.approx(want, rel=1e-12), (tp, dp)
    alone = Network.parse("2:1e12:0", devices=2)  # tp 2, no replicas: no copies
    got = predict_step_time(profile, alone, ParallelConfig(2, 1, 1, 1, "1f1b", (0, 2)),
                            global_batch=8)  # fmt: skip
    assert got.breakdown["update_s"] == pytest.approx(0.4 * 0.7 + 0.05, rel=1e-12)
    assert got.breakdown["dp_grad_copy_s"] == 0.0
    assert profile.scaled(0.5).blocks[0].grad_copy_s == pytest.approx(0.1)
    assert Profile.from_dict(profile.to_dict()).blocks[1].grad_copy_s == 0.03
    with pytest.raises(ValueError, match="grad_copy_s"):
        BlockProfile.from_dict(dataclasses.asdict(head) | {"grad_copy_s": -1.0}, "prof.json")


def test_larger_batches_are_interpolated_and_bend_the_sharded_line():
    """Above the profile's batch the block's time is piecewise linear through the measured
    batches (extrapolated along the last piece past them); below it, the line through the
    profile's two batches. A sharded layer's line bends by the same factor."""
    import dataclasses

    block = BlockProfile(name="layer", forward_s=1.0, backward_s=2.0, forward_fixed_s=0.2,
                         backward_fixed_s=0.4, activation_bytes=1e6, output_bytes=1e5,
                         param_bytes=1e6, tensor_parallel=True, tp_param_bytes=5e5,
                         batch_times={"8": {"forward_s": 2.4, "backward_s": 4.0},
                                      "16": {"forward_s": 5.6, "backward_s": 8.8}})  # fmt: skip
    profile = Profile(model="toy", batch=4, blocks=(block,), seq_len=16,
                      tensor_parallel_degrees=(1, 2))  # fmt: skip
    one = Network.parse("1:1e12:0", devices=1)

    def compute(micro: int, prof: Profile = profile, net: Network = one, tp: int = 1) -> float:
        got = predict_step_time(prof, net, ParallelConfig(tp, 1, 1, 1, "1f1b", (0, 1)),
                                global_batch=micro)  # fmt: skip
        return got.step_s - got.breakdown["update_s"]

    line = lambda b: 0.2 + 0.8 * b / 4 + 0.4 + 1.6 * b / 4  # noqa: E731
    assert compute(2) == pytest.approx(line(2), rel=1e-12)  # below: the line
    assert compute(4) == pytest.approx(3.0, rel=1e-12)
    assert compute(6) == pytest.approx((1.0 + 2.0) + (2.4 + 4.0 - 3.0) * 2 / 4, rel=1e-12)
    assert compute(12) == pytest.approx(6.4 + (14.4 - 6.4) * 4 / 8, rel=1e-12)
    assert compute(32) == pytest.approx(14.4 + (14.4 - 6.4) * 16 / 8, rel=1e-12)  # past 16
    plain = dataclasses.replace(profile, blocks=(dataclasses.replace(block, batch_times={}),))
    assert compute(12, plain) == pytest.approx(line(12), rel=1e-12)
    # the sharded layer's own line, bent like the whole block's at micro-batch 12
    sharded = {"forward_s": 0.6, "backward_s": 1.2, "forward_fixed_s": 0.1,
               "backward_fixed_s": 0.2}  # fmt: skip
    tp_prof = dataclasses.replace(
        profile, blocks=(dataclasses.replace(block, tp_times={"2": sharded}),)
    )
    free2 = Network.parse("2:1e12:0", devices=2)
    bend_f = (2.4 + (5.6 - 2.4) * 4 / 8) / (0.2 + 0.8 * 3)
    bend_g = (4.0 + (8.8 - 4.0) * 4 / 8) / (0.4 + 1.6 * 3)
    want = bend_f * (0.1 + 0.5 * 3) + bend_g * (0.2 + 1.0 * 3)
    assert compute(12, tp_prof, free2, 2) == pytest.approx(want, rel=1e-12)
    # JSON: kept, scaled, and only above the profile's batch
    assert Profile.from_dict(profile.to_dict()).blocks[0].batch_times == block.batch_times
    assert profile.scaled(0.5).blocks[0].batch_times["16"]["backward_s"] == pytest.approx(4.4)
    low = profile.to_dict()
    low["blocks"][0]["batch_times"] = {"4": {"forward_s": 1.0, "backward_s": 2.0}}
    with pytest.raises(ValueError, match="only those above the profile's 'batch' .4."):
        Profile.from_dict(low, "prof.json")
    for bad in ({"x": {"forward_s": 1.0, "backward_s": 1.0}}, {"8": {"forward_s": 1.0}},
                {"8": {"forward_s": -1.0, "backward_s": 1.0}}):  # fmt: skip
        with pytest.raises(ValueError, match="'batch_times' maps micro-batch sizes"):
            BlockProfile.from_dict(dataclasses.asdict(block) | {"batch_times": bad}, "prof.json")


@pytest.mark.slow  # a child process
def test_the_probe_shards_the_layer_on_a_fake_group(monkeypatch):
    """The probe's layer is the real sharded one: its local parameters are the replicated
    ones plus 1/t of each sharded tensor (Megatron's split), and it runs forward and
    backward at both batches."""
    from modelzoo.family import family_of
    from trainers.parallel.plan._tp_probe import time_sharded
    from trainers.parallel.tensor import bert_layers

    model = _tiny_bert_model(1)
    family = family_of(model, "test")
    layer = bert_layers(model)[0]
    total = sum(p.numel() for p in layer.parameters())
    sharded = 0
    for name, style in family.tp_plan.items():
        linear = layer.get_submodule(name)
        sharded += linear.weight.numel() + (
            linear.bias.numel() if style == "colwise" and linear.bias is not None else 0
        )
    x = torch.randn(4, 8, 16)
    got = time_sharded(layer, "", family.tp_plan, family.tp_attention, [x], [x[:2]], [2],
                       repeats=2, warmup=1)  # fmt: skip
    assert got is not None
    assert got["2"]["local_params"] == total - sharded + sharded // 2
    assert got["2"]["batch"]["forward_s"] > 0 and got["2"]["fit"]["backward_s"] > 0
    assert sum(p.numel() for p in layer.parameters()) == total  # the caller's layer untouched
    # a child that cannot start: no times, and the ranks' barrier still called twice
    synced = []
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", shutil.which("false"))
        assert time_sharded(layer, "", family.tp_plan, family.tp_attention, [x], None, [2],
                            repeats=1, warmup=0, sync=lambda: synced.append(1)) is None  # fmt: skip
    assert synced == [1, 1]


def test_measured_tensor_parallel_share_replaces_the_perfect_split():
    """A layer whose share at tp 2 was measured at 0.7 of the whole costs 0.7 (F + B), not
    (F + B) / 2: with one micro-batch, no pipeline and no data parallelism the step grows by
    exactly 0.2 (F + B); a degree not measured keeps the perfect split."""
    import dataclasses

    layer = BlockProfile(name="layer", forward_s=1.0, backward_s=2.0, activation_bytes=1e6,
                         output_bytes=1e5, param_bytes=1e6, tensor_parallel=True,
                         tp_param_bytes=9e5, tp_activation_bytes=5e5, tp_allreduce_bytes=1e5)  # fmt: skip
    plain = Profile(model="toy", batch=4, blocks=(layer,), seq_len=16,
                    tensor_parallel_degrees=(1, 2, 4))  # fmt: skip
    measured = dataclasses.replace(
        plain, blocks=(dataclasses.replace(layer, tp_time_ratio={"2": 0.7}),)
    )
    network = Network.parse("4:10:1e-5", devices=4)
    for tp, extra in ((2, 0.2 * 3.0), (4, 0.0)):
        config = ParallelConfig(tp, 1, 4 // tp, 1, "1f1b", (0, 1))
        a, b = (predict_step_time(p, network, config, global_batch=4 // tp * 4).step_s
                for p in (plain, measured))  # fmt: skip
        assert b - a == pytest.approx(extra, abs=1e-12), tp
    bad = dataclasses.asdict(layer) | {"tp_time_ratio": {"1": 0.5}}
    with pytest.raises(ValueError, match="'tp_time_ratio' maps degrees > 1"):
        BlockProfile.from_dict(bad, "prof.json: blocks[0]")
    with pytest.raises(ValueError, match="'tp_time_ratio' is set but 'tensor_parallel'"):
        BlockProfile.from_dict(dataclasses.asdict(layer) | {"tensor_parallel": False,
                               "tp_param_bytes": 0.0, "tp_activation_bytes": 0.0,
                               "tp_allreduce_bytes": 0.0, "tp_time_ratio": {"2": 0.6}}, "p")  # fmt: skip
