"""Throughput and utilisation: model FLOPs per token, tokens/s, TFLOPS, MFU, peak memory."""

from __future__ import annotations

import resource

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
