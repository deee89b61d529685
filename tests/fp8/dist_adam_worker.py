"""DeepSpeed ZeRO worker for tests/fp8/test_fp8_adam_deepspeed.py (CPU, gloo; launched by torchrun).

Trains a small MLP with FP8AdamW as DeepSpeed's client optimizer and writes rank 0's results to --out:

- `train`: `steps` steps; saves the full parameters.
- `resume`: `steps // 2` steps, DeepSpeed save_checkpoint, a fresh engine loads it, the rest of the steps;
  saves the full parameters (must equal `train`).

Each rank takes its rows of one global batch per step, so N ranks see what one rank sees with the full batch.
"""

from __future__ import annotations

import argparse
import os

import torch

from tests.helpers import MLP_SIZES, small_mlp

GLOBAL_BATCH = 8
D_IN, _, D_OUT = MLP_SIZES


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
    rows = GLOBAL_BATCH // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def make_engine(stage: int):
    import deepspeed

    from fp8.adam import FP8AdamW

    model = small_mlp()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    groups = [
        {"params": [p for p in model.parameters() if p.dim() > 1], "name": "matrices", "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() == 1], "name": "vectors", "weight_decay": 0.0},
    ]
    # min_fp8_numel=0 so that every flat partition (even the small bias group) takes the FP8 path.
    opt = FP8AdamW(groups, lr=3e-3, betas=(0.9, 0.95), block_size=128, min_fp8_numel=0)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def train(engine, start: int, stop: int) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    for step in range(start, stop):
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["train", "resume"], required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import deepspeed

    from ling.train.deepspeed_compat import skip_unused_op_builds

    # as the trainer starts DeepSpeed: no JIT build of its CPU shared-memory op
    skip_unused_op_builds(report=os.environ.get("RANK", "0") == "0")
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", "0"))
    engine = make_engine(args.stage)
    if args.mode == "train":
        train(engine, 0, args.steps)
    else:
        half = args.steps // 2
        train(engine, 0, half)
        engine.save_checkpoint(args.ckpt, tag="half")
        del engine
        engine = make_engine(args.stage)
        engine.load_checkpoint(args.ckpt, tag="half")
        train(engine, half, args.steps)
    result = {"params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}
    if rank == 0:
        torch.save(result, args.out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
