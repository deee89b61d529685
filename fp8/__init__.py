"""FP8 numerics: blockwise E4M3 quantizers, blockwise FP8 GEMMs, `FP8Linear`, `FP8AdamW`, health statistics.

Triton kernels run on CUDA tensors; every kernel has a plain-PyTorch reference used on CPU and in tests.
Importing this package needs neither CUDA nor Triton.
"""

from fp8.adam import FP8AdamW
from fp8.gemm import fp8_gemm, fp8_gemm_ref, fp8_gemm_wgrad, fp8_gemm_wgrad_ref
from fp8.health import distortion, health_stats, underflow
from fp8.linear import FP8Linear, invalidate_fp8_weight_caches
from fp8.quant import (
    fp8_transpose_128x128,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_1x128_ref,
    quantize_1x128_transposed,
    quantize_128x128,
    quantize_128x128_ref,
)

__all__ = [
    "FP8AdamW",
    "FP8Linear",
    "distortion",
    "fp8_gemm",
    "fp8_gemm_ref",
    "fp8_gemm_wgrad",
    "fp8_gemm_wgrad_ref",
    "fp8_transpose_128x128",
    "health_stats",
    "invalidate_fp8_weight_caches",
    "quantize_128x128",
    "quantize_128x128_ref",
    "quantize_1x128",
    "quantize_1x128_dual",
    "quantize_1x128_ref",
    "quantize_1x128_transposed",
    "underflow",
]
