"""Throughput and utilisation: model FLOPs per token, tokens/s, TFLOPS, MFU, peak memory."""

from __future__ import annotations

import resource
from collections.abc import Callable

import torch

from model.config import ModelConfig
from model.ling import ParameterCount

# dense bf16 tensor-core peak per GPU, TFLOPS (vendor datasheets); MFU is quoted against bf16 for both
# precisions so that FP8 and BF16 runs compare on one scale.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0}


def flops_per_token(config: ModelConfig, counts: ParameterCount, seq_len: int) -> float:
    """Training FLOPs per token: 6 · activated matmul parameters + causal attention 6 · L · T · heads·head_dim.

    Embedding lookups are not matmuls and are left out; the LM head counts once per MTP depth too.
    """
    embed = config.vocab_size * config.hidden_size
    head_calls = 1 + config.num_mtp_layers
    matmul_params = counts.activated + counts.mtp_activated - 2 * embed + head_calls * embed
    layers = config.num_layers + config.num_mtp_layers
    attention = 6 * layers * seq_len * config.num_heads * config.head_dim
    return 6.0 * matmul_params + attention


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by torch, or this process's peak RSS on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB on Linux


def allocator_retries(device: torch.device, memory_stats: Callable[[torch.device], dict] | None = None) -> int:
    """How often PyTorch's CUDA caching allocator has found no free block, released its cached blocks
    (`cudaFree`, which waits for the GPU) and tried again, since the process started (0 off CUDA). A step with
    retries stalled the host and the GPU: memory is near full or fragmented. `memory_stats`: torch.cuda.memory_stats
    (a test's stand-in)."""
    if device.type != "cuda":
        return 0
    return int((memory_stats or torch.cuda.memory_stats)(device).get("num_alloc_retries", 0))


# DeepSpeed's fp32 master weights: ZeRO-1/2, ZeRO-3 and the BF16_Optimizer (ZeRO-0 with bf16) keep them here
MASTER_WEIGHT_LISTS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def optimizer_state_bytes(optimizer, model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of optimizer state this rank holds: (state, master weights), each tensor counted once.

    state: the tensors in the torch optimizer's `state` (under DeepSpeed's wrapper, `optimizer.optimizer`) but
    the step counters: AdamW's fp32 exp_avg and exp_avg_sq; FP8AdamW's E4M3 moments and their fp32 block scales
    (fp32 moments for tensors under `min_fp8_numel`). Under ZeRO these are of this rank's flat partitions,
    padding included. master weights: the fp32 partitions of `MASTER_WEIGHT_LISTS` that are not the model's own
    parameter storage (ZeRO-1/2 always copy, also in fp32 on CPU; ZeRO-3 in fp32 and a plain torch optimizer
    update the parameters themselves: 0). Gradients and DeepSpeed's reduction buffers are not counted."""
    base = getattr(optimizer, "optimizer", optimizer)
    seen: set[tuple[int, int]] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            key = (t.data_ptr(), t.numel() * t.element_size())
            if key not in seen:
                seen.add(key)
                total += key[1]
        return total

    state = nbytes(v for s in base.state.values() for k, v in s.items() if k != "step" and isinstance(v, torch.Tensor))
    own = {t.untyped_storage().data_ptr() for p in model.parameters()
           for t in (p, getattr(p, "ds_tensor", None)) if t is not None and t.numel()}
    masters = [t for name in MASTER_WEIGHT_LISTS for t in getattr(optimizer, name, None) or ()
               if t.untyped_storage().data_ptr() not in own]
    return state, nbytes(masters)
