"""BERT-Base span-QA training step: ``modelzoo`` vs ``transformers.BertForQuestionAnswering``.

Both models hold the same BERT-Base weights (random, converted from the Hugging Face model
into ours) and train on the same padded SQuAD-shaped batch (sequence length 384, the second
half of one row padded, token types, start/end labels) with AdamW. One step is forward,
the start/end cross-entropy, backward and the optimizer step. Hugging Face runs with
``attn_implementation="sdpa"``, ours always uses ``scaled_dot_product_attention`` with one
fused query/key/value projection, and by default skips the padding's work
(``BertModel.set_unpadding``: the layers run on the real tokens; ``--no-unpad`` times the
padded model). Unpadded, the padding's span logits are -10000 rather than what its hidden
states give, so the two losses differ by the padding's share of the softmax normaliser; the
real tokens' logits are equal (``tests/modelzoo/test_bert_unpad.py``). Rounds alternate so machine noise hits both alike; the
ratio is the median over rounds of each round's paired ``hf_time / our_time`` (robust to
load that drifts between rounds on a shared machine) is printed too. Target (issue 21): ours
1.15x as fast (``ratio >= 1.15``).

    python benchmarks/bench_bert.py [--batch-size 2] [--seq-len 384] [--steps 2] [--rounds 5]
        [--no-unpad] [--json FILE]

Prints min/median/max of both sides, the machine, and ``ratio=<hf median / our median>`` last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _report import add_args, check_rounds, finish

from modelzoo.convert.bert import convert_hf_bert
from modelzoo.nlp.bert import BertConfig, BertForQuestionAnswering


def make_models(
    device: torch.device, config: BertConfig | None = None
) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers

    config = config or BertConfig()  # BERT-Base
    hf_config = transformers.BertConfig(**config.to_hf(), attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.BertForQuestionAnswering(hf_config)
    ours = BertForQuestionAnswering(config)
    ours.load_state_dict(convert_hf_bert(hf.state_dict(), ours))
    return ours.to(device).train(), hf.to(device).train()


def make_batch(batch_size: int, seq_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    mask[-1, seq_len // 2 :] = 0  # one padded window, as in a SQuAD batch
    types = torch.zeros_like(ids)
    types[:, 40:] = 1
    start = torch.randint(40, seq_len // 2, (batch_size,), generator=g)
    batch = dict(
        input_ids=ids, attention_mask=mask, token_type_ids=types, start=start, end=start + 3
    )
    return {k: v.to(device) for k, v in batch.items()}


def ours_step(model, opt, b) -> None:
    out = model(b["input_ids"], b["token_type_ids"], b["attention_mask"])
    loss = (F.cross_entropy(out.start, b["start"]) + F.cross_entropy(out.end, b["end"])) / 2
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def hf_step(model, opt, b) -> None:
    out = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"],
        token_type_ids=b["token_type_ids"],
    )  # fmt: skip
    loss = (
        F.cross_entropy(out.start_logits, b["start"]) + F.cross_entropy(out.end_logits, b["end"])
    ) / 2
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(step, model, opt, batch, steps: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, opt, batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--unpad", action=argparse.BooleanOptionalAction, default=True,
                        help="ours skips the padding's work (BertModel.set_unpadding)")  # fmt: skip
    add_args(parser, rounds=5)
    args = parser.parse_args()
    check_rounds(args.rounds)
    device = torch.device(args.device)
    ours, hf = make_models(device)
    ours.bert.set_unpadding(args.unpad)
    batch = make_batch(args.batch_size, args.seq_len, device)
    opts = {
        "ours": torch.optim.AdamW(ours.parameters(), lr=1e-5),
        "hf": torch.optim.AdamW(hf.parameters(), lr=1e-5),
    }
    ours_step(ours, opts["ours"], batch)  # warm-up: allocator, kernels, optimizer state
    hf_step(hf, opts["hf"], batch)
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    steps = {"ours": (ours_step, ours), "hf": (hf_step, hf)}
    for r in range(args.rounds):
        for name in ("ours", "hf") if r % 2 == 0 else ("hf", "ours"):  # alternate the order
            step, model = steps[name]
            times[name].append(timed(step, model, opts[name], batch, args.steps, device))
        print(f"round {r}: ours {times['ours'][-1]:.3f} s/step  hf {times['hf'][-1]:.3f} s/step",
              flush=True)  # fmt: skip
    paired = statistics.median(b / a for a, b in zip(times["ours"], times["hf"], strict=True))
    print(f"BERT-Base QA training step, batch {args.batch_size} x {args.seq_len} on {device}; "
          f"median of the rounds' paired hf/ours ratios {paired:.3f}")  # fmt: skip
    finish(args.json, "bench_bert", times["ours"], times["hf"],
           ours_label=f"modelzoo BERT-Base QA step, {args.batch_size} x {args.seq_len}"
           + (", unpadded" if args.unpad else ", padded"),
           peer_label="transformers BertForQuestionAnswering (sdpa) step", unit="s/step",
           target=1.15, extra={"paired_ratio": paired, "device": str(device), "unpad": args.unpad})  # fmt: skip


if __name__ == "__main__":
    main()
