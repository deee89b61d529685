"""Expert-parallel worker for tests/runtime/test_expert_parallel.py, launched by torchrun (every rank runs it): on CPU
with gloo (fp32), on a CUDA machine with NCCL, one GPU per rank (bf16).

Modes (rank 0 writes every rank's findings to --out as a torch file; a failed check raises on the rank that
saw it, and torchrun fails):

- `layer`: one MoE layer with its experts split over the ranks (moe.ep_size = world) against the whole layer
  in this process on the whole global batch (every rank computes that reference itself): the routed
  experts' output, the input and gate gradients and every expert gradient must be bit-identical, for
  fp32 and FP8 (torch reference) experts, with and without routing-map padding, and with a rank that
  receives no rows; the full layer (router included) to fp32 rounding (on GPUs: the FP8 Triton kernels
  bit-identical, bf16 within the bounds stated where checked). With TRITON_INTERPRET=1 also the FP8
  Triton kernels (interpreter) with padding: bit-identical too. Then the whole model: built with
  moe.ep_size = world from the same seed, each rank holds exactly its slice of the ep_size=1 model's experts
  (and the same dense weights); an HF export of the whole model loads into the expert-parallel one.
- `runs`: train runs one after the other in this one launch (a JSON list of {"dir", "overrides", optional
  "resume_copy": a checkpoint folder copied into the run's checkpoints first, "resave_to", "digests"; see
  `train_runs`); the test reads their metrics.jsonl and checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from kernels.interpreter import fixed_fp8_cast, lean_interpreter
from model.config import ModelConfig
from model.ling import LingForCausalLM
from model.moe import MoE
from tests.helpers import compose_cfg


def init_dist() -> tuple[int, int]:
    from ling.ranks import init_distributed

    init_distributed()  # gloo on CPU, through DeepSpeed (whose groups API the runs use)
    return dist.get_rank(), dist.get_world_size()


def device_and_dtype() -> tuple[torch.device, torch.dtype]:
    """CPU (fp32) or, on a CUDA machine, this rank's GPU (bf16)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    return torch.device("cpu"), torch.float32


def layer_pair(precision: str, pad: bool, world: int, group, **overrides) -> tuple[MoE, MoE]:
    """(whole layer, this rank's expert-parallel layer) with the same weights."""
    cfg = ModelConfig.preset("tiny", vocab_size=64, precision=precision, pad_for_fp8=pad, **overrides)
    device, dtype = device_and_dtype()
    torch.manual_seed(0)
    whole = MoE(cfg).to(device, dtype)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.05)
    split = MoE(cfg.replace(ep_size=world), group).to(device, dtype)
    state = whole.state_dict()
    shard = split.experts.local_experts
    split.load_state_dict({k: v[shard] if ".experts." in f".{k}" else v for k, v in state.items()})
    return whole, split


def routed(moe: MoE, x, idx, w, g):
    """Forward + backward of the routed experts alone → (out, dx, d gates, expert grads)."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = moe.routed_experts(x, idx, w)
    (out * g).sum().backward()
    return out.detach(), x.grad, w.grad, [p.grad for p in moe.experts.parameters()]


def check_layer(precision: str, pad: bool, starve: bool, rank: int, world: int, full: bool = True,
                per_rank: int = 24, **overrides) -> dict:
    """starve: the router's choices avoid the last rank's experts entirely (it receives no rows); full: also
    compare the whole layer's forward; per_rank: tokens per rank; overrides: of the tiny preset."""
    whole, split = layer_pair(precision, pad, world, dist.group.WORLD, **overrides)
    tokens, h, e = per_rank * world, whole.router.weight.shape[1], whole.router.num_experts
    device, dtype = device_and_dtype()
    gen = torch.Generator().manual_seed(1)
    x, g = (torch.randn(tokens, h, generator=gen).to(device, dtype) for _ in range(2))
    with torch.no_grad():
        if starve:
            for moe in (whole, split):
                moe.router.expert_bias[-(e // world):] = -10.0
        routing = whole.router(x)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    ref = routed(whole, x, routing.topk_idx, routing.topk_weight, g)
    got = routed(split, x[rows], routing.topk_idx[rows], routing.topk_weight[rows], g[rows])
    shard = split.experts.local_experts
    pairs = {"out": (got[0], ref[0][rows]), "dx": (got[1], ref[1][rows]), "dgate": (got[2], ref[2][rows])}
    for name, (mine, theirs) in zip(("gate_up_proj", "down_proj"), zip(got[3], ref[3])):
        pairs[f"grad {name}"] = (mine if mine is not None else torch.zeros_like(theirs[shard]), theirs[shard])
    if device.type == "cuda" and precision == "bf16":  # torch._grouped_mm (cuBLAS) may pick other kernels for
        # other group counts and sizes: bf16 rounding; bound 1 % of the norm (an assumption, not measured here)
        bad = [k for k, (a, b) in pairs.items() if float((a - b).float().norm()) > 1e-2 * float(b.float().norm())]
    else:  # CPU (the experts' loop, FP8 references) and the FP8 Triton kernels: the same segments, the same bits
        bad = [k for k, (a, b) in pairs.items() if not torch.equal(a, b)]
    assert not bad, f"rank {rank} {precision} pad={pad} starve={starve}: not bit-identical: {bad}"
    received = int(routing.tokens_per_expert.view(world, -1)[rank].sum())
    if not full:
        return {"received": received, "assignments": int(routing.topk_idx.numel())}
    # the full layer: the router's matmul sees this rank's tokens only (other shapes than the whole batch's),
    # so its logits may differ in the last bit; everything else follows
    out, _ = split(x[rows][None])
    want, _ = whole(x[None])
    if dtype == torch.float32:
        torch.testing.assert_close(out[0], want[0, rows], rtol=1e-5, atol=1e-6)
    else:  # bf16 on the GPU: a gate one ulp off can move an E4M3 rounding; bound 2 % of the norm (assumed)
        assert float((out[0] - want[0, rows]).float().norm()) <= 2e-2 * float(want[0, rows].float().norm())
    return {"received": received, "assignments": int(routing.topk_idx.numel())}


def check_model(rank: int, world: int, tmp: Path) -> None:
    from ling.checkpoint.hf import load_hf_checkpoint, save_hf

    cfg = ModelConfig.preset("tiny", vocab_size=64, num_layers=2)
    torch.manual_seed(0)
    whole = LingForCausalLM(cfg)
    torch.manual_seed(0)
    split = LingForCausalLM(cfg.replace(ep_size=world), dist.group.WORLD)

    def same(model: LingForCausalLM) -> list[str]:
        mine = model.state_dict()
        return [n for n, t in whole.state_dict().items()
                if not torch.equal(t if split.expert_shard(n) is None else t[split.expert_shard(n)], mine[n])]

    assert not same(split), f"rank {rank}: initial weights differ from the ep_size=1 model's: {same(split)}"
    if rank == 0:
        save_hf(whole.state_dict(), cfg, tmp / "hf", dtype=None)
    dist.barrier()
    torch.manual_seed(1)
    imported = LingForCausalLM(cfg.replace(ep_size=world), dist.group.WORLD)
    load_hf_checkpoint(imported, tmp / "hf")
    assert not same(imported), f"rank {rank}: HF import differs: {same(imported)}"


def train_runs(specs: list[dict], rank: int) -> dict:
    """Each spec: `ling.train.trainer.train` (logs, lock, signals as train.py), or with "resave_to" a Trainer that
    resumes and saves its state again at once (the re-partitioned state, for the test to compare), or with
    "digests" a Trainer that fits and reports a hash of each expert stack on every rank."""
    import hashlib

    from ling.checkpoint import store as checkpoint
    from ling.train.preemption import StopSignals
    from ling.train.trainer import Trainer, train

    out = {}
    for spec in specs:
        run_dir = Path(spec["dir"])
        if rank == 0 and spec.get("resume_copy"):
            src = Path(spec["resume_copy"])
            shutil.copytree(src, run_dir / "checkpoints" / src.name)
        dist.barrier()
        cfg = compose_cfg(spec["overrides"])
        if not (spec.get("resave_to") or spec.get("digests")):
            train(cfg, run_dir)
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(cfg, run_dir, StopSignals())
        try:
            if spec.get("resave_to"):
                state = {"loader": trainer.loader.state_dict(), "guard": trainer.guard.state_dict()}
                checkpoint.save(trainer.engine, Path(spec["resave_to"]), trainer.start_step, state, 0)
            else:
                trainer.fit()
                out[run_dir.name] = {"ep_rank": trainer.model.ep_rank, "experts": {
                    n: hashlib.sha256(p.detach().float().cpu().numpy().tobytes()).hexdigest()
                    for n, p in trainer.model.expert_parameters()}}
        finally:
            trainer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["layer", "runs"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", help="runs mode: a JSON file with the run specs")
    args = ap.parse_args()
    rank, world = init_dist()
    results: dict = {"world": world}
    if args.mode == "runs":
        results.update(train_runs(json.loads(Path(args.runs).read_text()), rank))
    if args.mode == "layer":
        check_model(rank, world, Path(args.out).parent)
        for precision in ("bf16", "fp8"):
            for pad in (False, True):
                results[(precision, pad, False)] = check_layer(precision, pad, False, rank, world)
        results[("fp8", True, True)] = check_layer("fp8", True, True, rank, world)
        if os.environ.get("TRITON_INTERPRET") == "1":
            os.environ["LING_FP8_BACKEND"] = "triton"
            with fixed_fp8_cast(), lean_interpreter():
                # fewer experts: the interpreter's cost grows with the kernels' tile count, not with the tokens
                results["triton"] = check_layer("fp8", True, False, rank, world, full=False, per_rank=16, num_experts=4,
                                                num_expert_groups=2, topk_groups=1, num_experts_per_tok=2)
            del os.environ["LING_FP8_BACKEND"]
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
