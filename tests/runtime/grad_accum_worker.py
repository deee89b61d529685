"""DeepSpeed bf16 + ZeRO on CPU (gloo), a bf16 linear layer, 8 micro-batches of one step on each rank, and the
gradient the optimizer receives against the float64 mean over ranks of the sum of the same 8 bf16 micro-batch
gradients (tests/runtime/test_grad_accum.py). Rank 0 prints one JSON line per case: {"case": "2:fp32",
"optimizer": class
name, "rel_err": ||seen - ref|| / ||ref||, "digest": sha256 of the seen gradient's bytes}; on several ranks the
error is rank 0's partition's. Engines come from ling.train.deepspeed_compat.initialize_engine (the trainer's), or with
`:stock` from plain deepspeed.initialize.

    python tests/runtime/grad_accum_worker.py 2:fp32 2:null 3:fp32      # ZeRO stage : deepspeed.grad_accum_dtype
    torchrun --nproc_per_node 2 tests/runtime/grad_accum_worker.py 1:fp32 2:fp32   # each rank its own inputs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MICRO_BATCHES = 8


class RecordGradient(torch.optim.Optimizer):
    """Keeps the gradient of each parameter it is handed (ZeRO's flat fp32 partition) and changes nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.seen: list[torch.Tensor] = []

    def step(self, closure=None):
        self.seen = [p.grad.detach().double().clone() for g in self.param_groups for p in g["params"]]


def run_case(stage: int, accum: str | None, fp32_communication: bool = False, stock: bool = False) -> dict:
    import deepspeed
    from omegaconf import OmegaConf

    from ling.train.deepspeed_compat import initialize_engine
    from ling.train.engine import deepspeed_config

    cfg = OmegaConf.create({"train": {"micro_batch_size": 1, "grad_accum": MICRO_BATCHES},
                            "optim": {"grad_clip": 0.0},
                            "deepspeed": {"zero_stage": stage, "grad_accum_dtype": accum,
                                          "extra": {"communication_data_type": "fp32"} if fp32_communication else {}}})
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 384, bias=False).to(torch.bfloat16)
    twin = torch.nn.Linear(512, 384, bias=False).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    opt = RecordGradient(model.parameters())
    conf = deepspeed_config(cfg, use_bf16=True)
    if stock:  # DeepSpeed's own classes, without ling.train.deepspeed_compat's substitutions
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    else:  # the trainer's engine
        engine, *_ = initialize_engine(model, opt, conf)
    # inputs of very different scale per micro-batch: a bf16 running sum loses the small ones' low bits
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(100 + rank)  # each rank its own micro-batches
    xs = [torch.randn(64, 512) * 4.0 ** (i % 4) for i in range(MICRO_BATCHES)]
    ref = torch.zeros(384 * 512, dtype=torch.float64)
    for x in xs:
        xb = x.to(torch.bfloat16)
        engine.backward(engine(xb).float().pow(2).mean())
        # the same micro-batch gradient by plain autograd (DeepSpeed scales the loss by 1/grad_accum)
        (twin(xb).float().pow(2).mean() / MICRO_BATCHES).backward()
        ref += twin.weight.grad.double().flatten()
        twin.weight.grad = None
        engine.step()
    torch.distributed.all_reduce(ref)  # the exact data-parallel mean of the exact sums
    ref /= world
    seen = torch.cat([t.flatten() for t in opt.seen])  # this rank's partition (ZeRO-1/2: contiguous, in order)
    start = rank * seen.numel() if world > 1 else 0
    seen, ref = seen[: max(0, min(seen.numel(), ref.numel() - start))], ref[start: start + seen.numel()]
    case = f"{stage}:{accum or 'null'}" + (":fp32_comm" if fp32_communication else "") + (":stock" if stock else "")
    return {"case": case, "optimizer": type(engine.optimizer).__name__,
            "rel_err": float((seen - ref).norm() / ref.norm()),
            "digest": hashlib.sha256(seen.numpy().tobytes()).hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="STAGE:DTYPE[:fp32_comm][:stock], DTYPE one of fp32, bf16, null; "
                    "fp32_comm sets deepspeed.extra.communication_data_type=fp32; stock builds the engine with plain "
                    "deepspeed.initialize instead of ling.train.deepspeed_compat.initialize_engine")
    args = ap.parse_args()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    from ling.train.deepspeed_compat import skip_unused_op_builds

    # as the trainer starts DeepSpeed: no JIT build of its CPU shared-memory op
    skip_unused_op_builds(report=os.environ.get("RANK", "0") == "0")
    for case in args.cases:
        stage, accum, *flags = case.split(":")
        row = run_case(int(stage), None if accum == "null" else accum, "fp32_comm" in flags, "stock" in flags)
        if os.environ["RANK"] == "0":
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
