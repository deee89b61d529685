"""Forward + backward of the model alone (no optimizer) and of its parts: what each model-side option costs.

    PYTHONUNBUFFERED=1 python3 bench/bench_model.py [--models ling_mini_2_0_e64,ling_mini_2_0_l6]
        [--seq-len 4096] [--micro 1] [--steps 6] [--warmup 2] [--precision bf16|fp8] [--doc-len 1024]
        [--variants fast,old_loss,dense_mask,selective,full,old_loss_dense_mask,causal,eager] [--no-profile]
        [--no-parts] [--loss-chunks 1024,2048,4096] [--loss-only]
    python3 bench/bench_model.py --device cpu --models tiny --seq-len 128   # smoke test

Every variant is a fresh model (same seed) on random tokens packed into documents of geometric length
(mean `--doc-len`, so attention runs with `doc_ids`); a step is forward + backward with gradients set to None
before it. Reports median tokens/s and model TFLOPS (6 · activated matmul params + causal attention per
token, recomputation not counted) and the peak memory of the timed steps (weights + gradients + activations).
Variants (one change each from `fast`):
  fast        fused chunked LM-head loss, flex document attention (auto: flex on CUDA), no recompute
  old_loss    materialised logits + fp32 cross-entropy (`return_logits=True`)
  dense_mask  SDPA with the dense [B, 1, T, T] document mask (repeated K/V)
  selective   model.recompute=selective;  full: model.recompute=full
  old_loss_dense_mask  old_loss + dense_mask (the model before the fused loss and flex attention)
  causal      no doc_ids at all (plain causal flash attention): the attention floor
  eager       model.compile_ops=off: the norms, QK-norm + RoPE, router, dispatch plan and SwiGLU run as eager
              ops instead of torch.compile'd functions (compiled on the first warm-up step)
Then (unless --no-parts) the LM head + loss and the attention core alone (`--loss-only`: the LM head rows and
nothing else), and (unless --no-profile) a
torch.profiler table of one `fast` step of the first model, GPU time grouped by part through the
`model.layers.scope` ranges (backward kernels follow their forward op's range through autograd's sequence
numbers). Prints the Markdown model table last. Not imported by the library.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ling.analysis.profiling import device_links, markdown, profiled, summarize  # noqa: E402
from ling.train.metrics import flops_per_token  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.layers import attend, document_block_mask, document_causal_mask, reference_attention  # noqa: E402
from model.ling import LingForCausalLM, count_parameters  # noqa: E402
from model.loss import cross_entropy, linear_cross_entropy  # noqa: E402

# variant → (ModelConfig overrides, forward keyword arguments, with doc_ids)
VARIANTS = {
    "fast": ({}, {}, True),
    "old_loss": ({}, {"return_logits": True}, True),
    "dense_mask": ({"document_attention": "dense"}, {}, True),
    "selective": ({"recompute": "selective"}, {}, True),
    "full": ({"recompute": "full"}, {}, True),
    "old_loss_dense_mask": ({"document_attention": "dense"}, {"return_logits": True}, True),
    "causal": ({}, {}, False),
    "eager": ({"compile_ops": "off"}, {}, True),
}

class Clock:
    """Wall time of a region, synchronising the device first; peak memory on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> int:
        self.sync()
        if self.device.type != "cuda":
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_gib(self, base: int = 0) -> float:
        if self.device.type != "cuda":
            return float("nan")
        return (torch.cuda.max_memory_allocated(self.device) - base) / 2**30

    def median_ms(self, fn, warmup: int, steps: int) -> float:
        times = []
        for i in range(warmup + steps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def make_batch(vocab: int, micro: int, seq_len: int, doc_len: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (micro, seq_len), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    doc_ids = torch.cumsum(torch.rand(micro, seq_len, generator=g) < 1.0 / doc_len, dim=1)
    return ids.to(device), labels.to(device), doc_ids.to(device)


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LingForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = LingForCausalLM(config)
    return model.to(dtype).train()


def model_step(model: LingForCausalLM, batch, forward_kw: dict, with_docs: bool):
    ids, labels, doc_ids = batch

    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, doc_ids=doc_ids if with_docs else None, **forward_kw)
        out.loss.backward()

    return step


def run_variant(name: str, base: ModelConfig, args, clock: Clock, dtype: torch.dtype) -> dict:
    overrides, forward_kw, with_docs = VARIANTS[name]
    config = base.replace(**overrides)
    model = build_model(config, clock.device, dtype)
    batch = make_batch(config.vocab_size, args.micro, args.seq_len, args.doc_len, clock.device)
    step = model_step(model, batch, forward_kw, with_docs)
    try:
        for _ in range(args.warmup):  # compiles flex, the loss epilogue and the fused ops on first use
            step()
        clock.reset_peak()
        ms = clock.median_ms(step, 0, args.steps)
        peak = clock.peak_gib()
    except torch.OutOfMemoryError:
        return {"variant": name, "error": "out of memory"}
    finally:
        model.zero_grad(set_to_none=True)
    tokens = args.micro * args.seq_len
    fpt = flops_per_token(config, count_parameters(config), args.seq_len)
    result = {"variant": name, "ms": ms, "tokens_per_s": tokens / ms * 1e3,
              "tflops": fpt * tokens / ms * 1e3 / 1e12, "peak_gib": peak}
    del model, step
    if clock.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ------------------------------------------------------------------ parts
def bench_parts(config: ModelConfig, args, clock: Clock, dtype: torch.dtype) -> list[list[str]]:
    """LM head + loss and the attention core of one layer, alone, at the model's shapes: [label, ms, peak GiB
    above the inputs, TFLOPS of the loss rows' three GEMMs (6·N·H·V)]."""
    dev = clock.device
    n, hidden, vocab = args.micro * args.seq_len, config.hidden_size, config.vocab_size
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape, std=1.0: (torch.randn(*shape, generator=g) * std).to(dev, dtype)  # noqa: E731
    rows = []

    def part(label: str, fn, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor | None = None,
             flops: float | None = None) -> None:
        def step():
            for t in inputs:
                t.grad = None
            fn().backward(grad_out)

        step()
        base = clock.reset_peak()
        ms = clock.median_ms(step, args.warmup, args.steps)
        rows.append([label, f"{ms:.2f}", f"{clock.peak_gib(base):.2f}", f"{flops / ms / 1e9:.0f}" if flops else ""])

    h, w = rand(n, hidden).requires_grad_(True), rand(vocab, hidden, std=0.02).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), generator=g).to(dev)
    head = f"LM head + loss ({n} tokens x vocab {vocab})"
    flops = 6 * n * hidden * vocab
    part(f"{head}: materialised logits, fp32 CE", lambda: cross_entropy(F.linear(h, w), labels), (h, w), flops=flops)
    part(f"{head}: chunked, eager epilogue", lambda: linear_cross_entropy(h, w, labels, epilogue="eager"), (h, w),
         flops=flops)
    if dev.type == "cuda":
        part(f"{head}: chunked, compiled epilogue", lambda: linear_cross_entropy(h, w, labels, epilogue="compiled"),
             (h, w), flops=flops)
        part(f"{head}: chunked, Triton epilogue (default)", lambda: linear_cross_entropy(h, w, labels), (h, w),
             flops=flops)
    for chunk in args.loss_chunks:  # each chunk size's logits GEMMs and its fp32 dW read-modify-write per chunk
        part(f"{head}: chunks of {chunk} tokens", lambda c=chunk: linear_cross_entropy(h, w, labels, chunk_size=c),
             (h, w), flops=flops)
    if args.loss_only:
        return rows

    B, T, Hq, Hkv, D = args.micro, args.seq_len, config.num_heads, config.num_kv_heads, config.head_dim
    q, k, v = (rand(B, heads, T, D).requires_grad_(True) for heads in (Hq, Hkv, Hkv))
    grad_out = rand(B, Hq, T, D)
    _, _, doc_ids = make_batch(vocab, B, T, args.doc_len, dev)
    dense_mask = document_causal_mask(doc_ids)
    core = f"attention core ({B}x{T}, {Hq}/{Hkv} heads, D {D})"
    part(f"{core}: causal, SDPA enable_gqa", lambda: attend(q, k, v, None), (q, k, v), grad_out)
    part(f"{core}: causal, repeated K/V", lambda: reference_attention(q, k, v, None), (q, k, v), grad_out)
    part(f"{core}: documents, dense mask + repeated K/V", lambda: reference_attention(q, k, v, dense_mask),
         (q, k, v), grad_out)
    if dev.type == "cuda":
        block_mask = document_block_mask(doc_ids)
        part(f"{core}: documents, flex BlockMask", lambda: attend(q, k, v, block_mask), (q, k, v), grad_out)
        ms = clock.median_ms(lambda: document_block_mask(doc_ids), args.warmup, args.steps)
        rows.append([f"BlockMask from doc_ids [{B}, {T}] (once per forward)", f"{ms:.2f}", ""])
    return rows


# ------------------------------------------------------------------ profile
def profile_table(config: ModelConfig, args, clock: Clock, dtype: torch.dtype, steps: int = 2) -> str:
    """The grouped profile table (markdown) of `steps` steps of the model after the warm-up."""
    model = build_model(config, clock.device, dtype)
    batch = make_batch(config.vocab_size, args.micro, args.seq_len, args.doc_len, clock.device)
    step = model_step(model, batch, {}, True)
    for _ in range(args.warmup):
        step()
    with profiled(clock.device) as result:
        for _ in range(steps):
            step()
    summary = summarize(result["profile"].events(), steps, clock.device.type == "cuda",
                        links=device_links(result["profile"]))
    del model, step
    return markdown(summary.part_header(), summary.part_rows())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="ling_mini_2_0_e64,ling_mini_2_0_l6")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--doc-len", type=int, default=1024, help="mean document length in tokens")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loss-chunks", default="", type=lambda v: [int(c) for c in v.split(",") if c],
                    help="also time the fused LM-head loss at these chunk sizes (tokens), e.g. 1024,2048,4096")
    ap.add_argument("--loss-only", action="store_true", help="time the LM-head loss rows only, nothing else")
    ap.add_argument("--no-parts", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    clock = Clock(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = args.models.split(",")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)})")
    configs = {m: ModelConfig.preset(m, precision=args.precision, **({"vocab_size": 8192} if m == "tiny" else {}))
               for m in models}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# bench_model on {where}, torch {torch.__version__}, {args.precision} linears, {dtype} weights and "
          f"activations, seq {args.seq_len} x micro "
          f"{args.micro}, documents of mean length {args.doc_len}, medians of {args.steps} steps", flush=True)

    if not args.no_parts:
        rows = bench_parts(configs[models[0]], args, clock, dtype)
        print(f"\n### Parts of {models[0]}, forward + backward\n")
        print(markdown(["part", "ms", "peak GiB above inputs", "TFLOPS (6·N·H·V)"], rows), flush=True)
        if args.loss_only:
            return
    if not args.no_profile:
        table = profile_table(configs[models[0]], args, clock, dtype)
        unit = "GPU ms" if device.type == "cuda" else "CPU self ms"
        print(f"\n### Where one `fast` step of {models[0]} spends its time ({unit} per step)\n")
        print(table, flush=True)

    results = []
    for m in models:
        for v in variants:
            r = run_variant(v, configs[m], args, clock, dtype)
            r["model"] = m
            print(f"{m} {v}: {r}", flush=True)
            results.append(r)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["model"], r["variant"], r["error"], "", "", "", ""])
            continue
        fast = next((x for x in results if x["model"] == r["model"] and x["variant"] == "fast" and "ms" in x), None)
        vs = f"{fast['ms'] / r['ms']:.2f}x" if fast else ""
        rows.append([r["model"], r["variant"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}", vs,
                     f"{r['tflops']:.0f}", f"{r['peak_gib']:.1f}"])
    print(f"\n### Model forward + backward ({args.precision} linears, {where}, seq {args.seq_len} x micro-batch "
          f"{args.micro})\n")
    print(markdown(["model", "variant", "step ms", "tokens/s", "speed vs fast", "model TFLOPS", "peak GiB"], rows))


if __name__ == "__main__":
    main()
