"""One rank of the pipeline-parallel checks (``test_pipeline_parallel.py``).

Each rank builds the same float64 model twice: one copy is split into a pipeline stage, the
other runs whole as the oracle, over the same micro-batches one after the other (gradient
accumulation of the mean loss). For GPipe and 1F1B, rank 0 collects every stage's largest
gradient and BatchNorm-statistics difference and the last stage's losses, and writes
``<out>/result.pt``.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from modelzoo.nlp.bert import BertForQuestionAnswering, BertForSequenceClassification
from tests.trainers._tp_worker import CONFIG as TP_CONFIG
from tests.trainers._tp_worker import QAData, qa_step
from trainers import DistEnv, Trainer, TrainerConfig
from trainers.optim import Lamb
from trainers.parallel.pipeline import PipelinedModel, build_pipeline, model_blocks

MICRO = 4
BERT = dataclasses.replace(TP_CONFIG, num_layers=4)  # the tensor-parallel checks' BERT, deeper


def span_loss(logits: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    start, end = logits.unbind(-1)
    return F.cross_entropy(start, spans[:, 0]) + F.cross_entropy(end, spans[:, 1])


def bert_case(kind: str):
    torch.manual_seed(0)
    model = (
        BertForQuestionAnswering(BERT) if kind == "qa" else BertForSequenceClassification(BERT, 3)
    ).double()
    gen = torch.Generator().manual_seed(1)
    n, length = 8, 10
    ids = torch.randint(0, BERT.vocab_size, (n, length), generator=gen)
    types = torch.randint(0, 2, (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[:, -2:] = torch.randint(0, 2, (n, 2), generator=gen)
    if kind == "qa":
        target = torch.randint(0, length, (n, 2), generator=gen)

        def whole(m, i, t, k):
            out = m(i, t, k)
            return torch.stack([out.start, out.end], -1)

        return model, (ids, types, mask), target, span_loss, whole
    target = torch.randint(0, 3, (n,), generator=gen)
    return model, (ids, types, mask), target, F.cross_entropy, lambda m, i, t, k: m(i, t, k)


def resnest_case():
    import modelzoo

    torch.manual_seed(0)
    model = modelzoo.get_model("resnest14", num_classes=5).double()
    gen = torch.Generator().manual_seed(2)
    images = torch.randn(8, 3, 32, 32, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 5, (8,), generator=gen)
    return model, (images,), target, F.cross_entropy, lambda m, x: m(x)


def run(case, schedule: str, rank: int, world: int, boundaries=None) -> dict:
    model, inputs, target, loss_fn, whole = case
    ref = copy.deepcopy(model)
    ref.train()
    model.train()
    micro = [x[: len(target) // MICRO] for x in inputs]
    pipe = build_pipeline(
        model, rank=rank, num_stages=world, micro_batches=MICRO, loss_fn=loss_fn,
        example_inputs=micro, schedule=schedule, boundaries=boundaries,
    )  # fmt: skip
    losses = pipe.step(inputs, target)
    ref_losses = []
    size = len(target) // MICRO
    for k in range(MICRO):
        part = slice(k * size, (k + 1) * size)
        loss = loss_fn(whole(ref, *(x[part] for x in inputs)), target[part])
        (loss / MICRO).backward()
        ref_losses.append(loss.detach())
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    own = [(names[id(p)], p) for p in pipe.module.parameters()]
    grad_err = max((p.grad - ref_params[n].grad).abs().max().item() for n, p in own)
    grad_scale = max(ref_params[n].grad.abs().max().item() for n, _ in own)
    ref_buffers = dict(ref.named_buffers())
    buffer_names = {id(b): n for n, b in model.named_buffers()}
    stats_err = max(
        [
            (b.double() - ref_buffers[buffer_names[id(b)]].double()).abs().max().item()
            for b in pipe.module.buffers()
        ]
        or [0.0]
    )
    loss_err = max(
        [(a - b).abs().item() for a, b in zip(losses, ref_losses, strict=True)] if losses else [0.0]
    )
    return {
        "grad_err": grad_err,
        "grad_scale": grad_scale,
        "stats_err": stats_err,
        "loss_err": loss_err,
        "n_losses": len(losses),
        "n_params": len(own),
        "blocks": (pipe.module.start, pipe.module.end),
        "n_blocks": len(model_blocks(model)),
    }


def qa_trainer(env, pp_group, steps: int, batch: int, tp_mesh=None) -> Trainer:
    """The tensor-parallel checks' QA trainer (LAMB, gradient clip 0.5, float64, 2
    accumulation steps), with the model pipelined over ``pp_group`` (2 micro-batches, 1F1B)
    when given, and its layers split over ``tp_mesh`` too when given."""
    torch.manual_seed(0)
    model = BertForQuestionAnswering(dataclasses.replace(BERT, num_layers=3)).double()
    if pp_group is not None:
        model = PipelinedModel(
            model, group=pp_group, micro_batches=2, boundaries=[0, 3, 5],
            inputs_of=lambda b: (b[0], b[1], torch.ones_like(b[0])), tensor_mesh=tp_mesh,
        )  # fmt: skip
    optimizer = Lamb(model.parameters(), lr=0.02, weight_decay=0.01)
    config = TrainerConfig(
        max_steps=steps,
        epochs=10,
        batch_size=batch,
        seed=3,
        log_interval=0,
        clip_grad_norm=0.5,
        grad_accum_steps=2,
    )
    return Trainer(model, optimizer, config, env=env, train_step=pp_step, eval_step=qa_eval)


def pp_step(model, batch):
    loss, sums = qa_step(model, batch)
    return loss, {"span_loss": sums["loss"], "count": sums["count"]}  # "loss" is the trainer's


def qa_eval(model, batch):
    return pp_step(model, batch)[1]


def trainer_checks(res: dict, world: int, out: Path, tp: int = 1) -> None:
    """Through the shared Trainer: dp x pp (2 stages; x tp with ``tp`` > 1, Megatron's rank
    order) against one process on the global batch; the checkpoint's model in the unsplit
    format and its optimizer state per stage; evaluation of the whole model; resume bit for
    bit."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // (2 * tp)
    if tp == 1:
        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "pp"))
        tp_mesh = None
    else:
        mesh = init_device_mesh("cpu", (dp, 2, tp), mesh_dim_names=("dp", "pp", "tp"))
        tp_mesh = mesh["tp"]
    env = DistEnv.from_env().data_parallel(mesh["dp"])
    one = DistEnv(rank=0, world_size=1)  # every rank runs the oracle on its own
    data = QAData()
    group = mesh["pp"].get_group()
    ref = qa_trainer(one, None, 2, 2 * dp)
    ref.fit(data)
    ref_state = ref.state_dict()
    first = qa_trainer(env, group, 2, 2, tp_mesh)
    first.fit(data)
    res["trainer_eval"] = (first.evaluate(data), ref.evaluate(data))
    res["trainer_sharded"] = sum(
        isinstance(p, DTensor) and any(isinstance(q, Shard) for q in p.placements)
        for p in first.model.parameters()
    )
    path = out / f"pp_mid_{world}_{tp}.pt"
    first.save_checkpoint(path)
    state = torch.load(path, weights_only=False)
    res["trainer_model_err"] = max(
        (state["model"][k] - ref_state["model"][k]).abs().max().item() for k in ref_state["model"]
    )
    res["trainer_model_keys"] = sorted(state["model"]) == sorted(ref_state["model"])
    # Each stage's optimizer state against the reference's, matched by parameter name.
    names = {id(p): n for n, p in first.model.full_model.named_parameters()}
    ref_index = {n: i for i, (n, _) in enumerate(ref.model.named_parameters())}
    blocks, bounds = first.model._blocks, first.model.boundaries
    errs = []
    for s_, stage_state in enumerate(state["optimizer"]["pipeline_stages"]):
        params = [p for b in blocks[bounds[s_] : bounds[s_ + 1]] for p in b.parameters()]
        for i, p in enumerate(params):
            mine, theirs = (
                stage_state["state"][i],
                ref_state["optimizer"]["state"][ref_index[names[id(p)]]],
            )
            errs += [(mine[k] - theirs[k]).abs().max().item() for k in theirs
                     if torch.is_tensor(theirs[k]) and theirs[k].dim() > 0]  # fmt: skip
    res["trainer_opt_err"] = max(errs)
    res["trainer_opt_count"] = len(errs)
    resumed = qa_trainer(env, group, 4, 2, tp_mesh)
    resumed.resume(path)
    resumed.fit(data)
    straight = qa_trainer(env, group, 4, 2, tp_mesh)
    straight.fit(data)
    a, b = resumed.model.state_dict(), straight.model.state_dict()
    res["trainer_resume_err"] = max((a[k] - b[k]).abs().max().item() for k in a)
    ref4 = qa_trainer(one, None, 4, 2 * dp)
    ref4.fit(data)
    c = ref4.model.state_dict()
    res["trainer_final_err"] = max((b[k] - c[k]).abs().max().item() for k in c)
    res["trainer_moved"] = max((c[k] - ref_state["model"][k]).abs().max().item() for k in c)


def main(out: Path, tp: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    if tp == 1:  # with tp > 1: the Trainer over a (dp, pp, tp) mesh only
        schedule_checks(results, rank, world)
    trainer: dict = {}
    trainer_checks(trainer, world, out, tp)
    results["trainer"] = trainer
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out / "result.pt")
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def schedule_checks(results: dict, rank: int, world: int) -> None:
    """Both schedules against the unsplit model (see the module docstring)."""
    plan = [("qa", "gpipe"), ("qa", "1f1b")]
    if world == 2:  # (the suite's time: the 4-stage run checks span QA only)
        plan += [("cls", "1f1b"), ("resnest", "gpipe"), ("resnest", "1f1b")]
    cases = {
        "qa": lambda: bert_case("qa"),
        "cls": lambda: bert_case("cls"),
        "resnest": resnest_case,
    }
    for name, schedule in plan:
        results[(name, schedule)] = run(cases[name](), schedule, rank, world)
    # Boundaries given by hand: BERT's 6 blocks as [embeddings + 3 layers | 1 layer + head].
    if world == 2:
        results[("qa", "manual")] = run(bert_case("qa"), "1f1b", rank, world, [0, 4, 6])


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
