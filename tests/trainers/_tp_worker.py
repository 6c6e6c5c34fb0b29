"""One rank of the tensor-parallel BERT checks (``test_tensor_parallel.py``).

Every rank builds the same small float64 BERT, keeps an unsplit copy as the oracle, lays the
other out with ``parallelize_bert`` over a ``(dp, tp)`` mesh and measures: forward outputs and
gradients against the copy's, the collectives of one forward and one backward
(``CommDebugMode``), the local parameter sizes, the state dict, LAMB / LANS steps on the sharded
parameters, and a dp x tp step against one unsplit step on the concatenated batch. Rank 0
writes what it measured to ``<out>/rank0.pt``; every rank writes its own parameter sizes.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from modelzoo.nlp.bert import BertConfig, BertForPretraining, BertForQuestionAnswering
from trainers import DistEnv, Trainer, TrainerConfig
from trainers.optim import Lamb, Lans
from trainers.parallel import parallelize_bert, qkv_permutation, sharded_parameter_names

CONFIG = BertConfig(
    vocab_size=50,
    hidden_size=24,
    num_layers=2,
    num_heads=4,
    intermediate_size=40,
    max_position_embeddings=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def unsplit_grads(model: torch.nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """The model's gradients in the unsplit layout (qkv rows back in [q; k; v] order)."""
    inverse = torch.argsort(
        qkv_permutation(CONFIG.num_heads, CONFIG.hidden_size // CONFIG.num_heads, tp)
    )
    out = {}
    for name, p in model.named_parameters():
        g = full(p.grad).detach().clone()
        if ".attn.qkv." in name:
            g = g[inverse]
        out[name] = g
    return out


def batch(seed: int, n: int, length: int = 12) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (n, length), generator=gen)
    types = torch.randint(0, 2, (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[:, length - 3 :] = torch.randint(0, 2, (n, 3), generator=gen)  # some padding
    positions = torch.randint(0, length, (n, 4), generator=gen)
    weights = torch.randn(n, 4, CONFIG.vocab_size, generator=gen, dtype=torch.float64)
    return {"ids": ids, "types": types, "mask": mask, "positions": positions, "w": weights}


def loss_of(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(b["ids"], b["types"], b["mask"], masked_positions=b["positions"])
    return (out.mlm_logits * b["w"]).sum() + out.nsp_logits.square().sum()


class QAData(torch.utils.data.Dataset):
    """Random token windows with random answer spans (float64 model, so no noise)."""

    def __init__(self, n: int = 24, length: int = 10) -> None:
        gen = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, CONFIG.vocab_size, (n, length), generator=gen)
        self.types = torch.randint(0, 2, (n, length), generator=gen)
        self.spans = torch.randint(0, length, (n, 2), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i], self.types[i], self.spans[i]


def qa_step(model, batch):
    ids, types, spans = batch
    out = model(ids, types)
    loss = F.cross_entropy(out.start, spans[:, 0]) + F.cross_entropy(out.end, spans[:, 1])
    return loss, {"loss": loss.detach() * len(ids), "count": len(ids)}


def qa_trainer(env, tp_mesh, steps: int, batch: int, optimizer: str = "lamb") -> Trainer:
    torch.manual_seed(0)
    model = BertForQuestionAnswering(CONFIG).double()
    if tp_mesh is not None:
        parallelize_bert(model, tp_mesh)
    # LAMB: LANS normalises each gradient, which turns the span bias's gradient (0 up to
    # rounding: a shift of all logits) into a unit vector of rounding noise. AdamW (torch's,
    # finetune_squad's default) keeps its state as DTensors, LAMB on the local shards.
    if optimizer == "lamb":
        opt: torch.optim.Optimizer = Lamb(model.parameters(), lr=0.02, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    config = TrainerConfig(
        max_steps=steps, epochs=10, batch_size=batch, seed=3, log_interval=0, clip_grad_norm=0.5
    )
    return Trainer(model, opt, config, env=env, train_step=qa_step)


def trainer_checks(res: dict, rank: int, world: int, out: Path, optimizer: str = "lamb") -> None:
    """Through the shared Trainer: a dp x tp run (``optimizer``, the trainer's gradient
    clip) against one process on the global batch; its checkpoint in the unsplit format;
    resume."""
    tp = 2
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    env = DistEnv.from_env().data_parallel(mesh["dp"])
    one = DistEnv(rank=0, world_size=1)  # every rank runs the oracle on its own
    data = QAData()
    ref = qa_trainer(one, None, 2, 2 * dp, optimizer)
    ref.fit(data)
    ref_state = ref.state_dict()
    # 2 steps, checkpoint, then 2 more from the checkpoint against 4 straight.
    first = qa_trainer(env, mesh["tp"], 2, 2, optimizer)
    first.fit(data)
    path = out / f"tp_mid_{optimizer}.pt"
    first.save_checkpoint(path)
    state = torch.load(path, weights_only=False)
    res[f"trainer_dp{dp}_model_err"] = max(
        (state["model"][k] - ref_state["model"][k]).abs().max().item() for k in ref_state["model"]
    )
    res[f"trainer_dp{dp}_model_plain"] = not any(
        isinstance(v, DTensor) for v in state["model"].values()
    )
    opt, ref_opt = state["optimizer"]["state"], ref_state["optimizer"]["state"]
    res[f"trainer_dp{dp}_opt_err"] = max(
        (opt[i][k] - ref_opt[i][k]).abs().max().item()
        for i in ref_opt
        for k in ref_opt[i]
        if torch.is_tensor(ref_opt[i][k]) and ref_opt[i][k].dim() > 0
    )
    res[f"trainer_dp{dp}_opt_plain"] = not any(
        isinstance(v, DTensor) for entry in opt.values() for v in entry.values()
    )
    res[f"trainer_dp{dp}_opt_shapes"] = all(
        opt[i][k].shape == ref_opt[i][k].shape
        for i in ref_opt
        for k in ref_opt[i]
        if torch.is_tensor(ref_opt[i][k])
    )
    plain = BertForQuestionAnswering(CONFIG).double()
    plain.load_state_dict(state["model"])  # strict: the single-process format
    resumed = qa_trainer(env, mesh["tp"], 4, 2, optimizer)
    resumed.resume(path)
    resumed.fit(data)
    straight = qa_trainer(env, mesh["tp"], 4, 2, optimizer)
    straight.fit(data)
    a, b = resumed.model.state_dict(), straight.model.state_dict()
    res[f"trainer_dp{dp}_resume_err"] = max((a[k] - b[k]).abs().max().item() for k in a)
    ref4 = qa_trainer(one, None, 4, 2 * dp, optimizer)
    ref4.fit(data)
    c = ref4.model.state_dict()
    res[f"trainer_dp{dp}_final_err"] = max((b[k] - c[k]).abs().max().item() for k in c)
    res[f"trainer_dp{dp}_moved"] = max((c[k] - ref_state["model"][k]).abs().max().item() for k in c)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    res: dict[str, object] = {}
    for dp, tp in [(1, world), (world // 2, 2)] if world == 4 else [(1, world)]:
        key = f"dp{dp}_tp{tp}"
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        ref = BertForPretraining(CONFIG).double()
        # The tp ranks initialise differently: parallelize_bert must make them one model
        # (the dp replicas start equal, as DDP's broadcast makes them).
        first = mesh["tp"].get_local_rank() == 0
        torch.manual_seed(0 if first else 100 + rank)
        model = BertForPretraining(CONFIG).double()
        if first:
            model.load_state_dict(ref.state_dict())
        parallelize_bert(model, mesh["tp"])

        if dp == 1:
            # Forward and gradients against the unsplit model.
            b = batch(1, 3)
            with CommDebugMode() as fwd_comm:
                loss = loss_of(model, b)
            with CommDebugMode() as bwd_comm:
                loss.backward()
            ref_loss = loss_of(ref, b)
            ref_loss.backward()
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
            grads = unsplit_grads(model, tp)
            res[f"{key}_loss"] = (loss.item(), ref_loss.item())
            res[f"{key}_grad_err"] = max(
                (grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads
            )
            res[f"{key}_grad_keys"] = sorted(grads) == sorted(ref_grads)
            res[f"{key}_fwd_comm"] = {str(k): v for k, v in fwd_comm.get_comm_counts().items()}
            res[f"{key}_bwd_comm"] = {str(k): v for k, v in bwd_comm.get_comm_counts().items()}
            # Local parameter sizes.
            sharded = set(sharded_parameter_names(model))
            local = {
                n: p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                for n, p in model.named_parameters()
            }
            whole = {n: p.numel() for n, p in ref.named_parameters()}
            res[f"{key}_sharded"] = sorted(sharded)
            res[f"{key}_local_rank{rank}"] = local
            res[f"{key}_whole"] = whole
            # State dict: the unsplit format, equal to the reference's.
            sd = model.state_dict()
            ref_sd = ref.state_dict()
            res[f"{key}_sd_plain"] = not any(isinstance(v, DTensor) for v in sd.values())
            res[f"{key}_sd_keys"] = sorted(sd) == sorted(ref_sd)
            res[f"{key}_sd_err"] = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
            # Loading an unsplit state dict into a tensor-parallel model.
            torch.manual_seed(7)
            other = BertForPretraining(CONFIG).double()
            parallelize_bert(other, mesh["tp"])
            other.load_state_dict(ref_sd)
            b2 = batch(2, 2)
            with torch.no_grad():
                res[f"{key}_load_err"] = (loss_of(other, b2) - loss_of(ref, b2)).abs().item()
            # LAMB / LANS on sharded parameters against the unsplit ones (3 steps).
            for name, make in [
                ("lamb", lambda ps: Lamb(ps, lr=0.05, weight_decay=0.01, max_grad_norm=1.0)),
                ("lans", lambda ps: Lans(ps, lr=0.05, weight_decay=0.01, max_grad_norm=1.0)),
            ]:
                torch.manual_seed(0)
                r = BertForPretraining(CONFIG).double()
                m = copy.deepcopy(r)
                parallelize_bert(m, mesh["tp"])
                start = {k: v.clone() for k, v in r.state_dict().items()}
                opt_r, opt_m = make(r.parameters()), make(m.parameters())
                for step in range(3):
                    for net, opt in ((r, opt_r), (m, opt_m)):
                        opt.zero_grad()
                        loss_of(net, batch(10 + step, 3)).backward()
                        opt.step()
                msd, rsd = m.state_dict(), r.state_dict()
                res[f"{key}_{name}_err"] = max((msd[k] - rsd[k]).abs().max().item() for k in rsd)
                res[f"{key}_{name}_moved"] = min(
                    (rsd[k] - start[k]).abs().max().item() for k in rsd if k.endswith("weight")
                )
        else:
            # dp x tp: each dp rank its half of the batch, gradients averaged over dp.
            b = batch(3, 4)
            dp_rank = mesh["dp"].get_local_rank()
            part = {k: v[dp_rank * 2 : dp_rank * 2 + 2] for k, v in b.items()}
            loss = loss_of(model, part) / 2  # mean over the 2 samples of this dp rank
            loss.backward()
            group = mesh["dp"].get_group()
            for p in model.parameters():
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=group)
                g.div_(dp)
            ref_loss = loss_of(ref, b) / 4
            ref_loss.backward()
            grads = unsplit_grads(model, tp)
            res[f"{key}_grad_err"] = max(
                (grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()
            )
            res[f"{key}_grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters())
            # ... and one LAMB step from those gradients lands on the same weights.
            before = {k: v.clone() for k, v in ref.state_dict().items()}
            for net in (model, ref):
                Lamb(net.parameters(), lr=0.05, weight_decay=0.01, max_grad_norm=1.0).step()
            msd, rsd = model.state_dict(), ref.state_dict()
            res[f"{key}_step_err"] = max((msd[k] - rsd[k]).abs().max().item() for k in rsd)
            res[f"{key}_step_moved"] = min(
                (rsd[k] - before[k]).abs().max().item() for k in rsd if k.endswith("weight")
            )
        dist.barrier()
    trainer_checks(res, rank, world, out)
    if world == 2:  # torch's AdamW: DTensor state, gathered and re-laid out on resume
        adamw: dict[str, object] = {}
        trainer_checks(adamw, rank, world, out, "adamw")
        res.update({f"adamw_{k}": v for k, v in adamw.items()})
    # Span QA (the fine-tuning model) splits the same way.
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = BertForQuestionAnswering(CONFIG).double()
    model = copy.deepcopy(ref)
    parallelize_bert(model, mesh["tp"])
    b = batch(4, 3)
    outs = [net(b["ids"], b["types"], b["mask"]) for net in (model, ref)]
    res["qa_err"] = max(
        (outs[0].start - outs[1].start).abs().max().item(),
        (outs[0].end - outs[1].end).abs().max().item(),
    )
    if rank == 0:
        torch.save(res, out / "rank0.pt")
    else:
        torch.save({k: v for k, v in res.items() if "_local_rank" in k}, out / f"rank{rank}.pt")
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
