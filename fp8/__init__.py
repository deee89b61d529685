"""FP8 numerics: blockwise E4M3 quantizers, blockwise FP8 GEMMs, `FP8Linear`, `FP8AdamW`, health statistics.

Triton kernels run on CUDA tensors; every kernel has a plain-PyTorch reference used on CPU and in tests.
Importing this package needs neither CUDA nor Triton. The format's constants are fp8/format.py's; the kernels'
launch configs (`GEMM_TUNING`, `QUANT_TUNING`, `fp8.grouped.GROUPED_TUNING`) sit beside them, each a frozen
default overridable inside a `with ....override(...):` block.
"""

from fp8.adam import FP8AdamW
from fp8.format import BLOCK, E4M3, E4M3_MAX
from fp8.gemm import GEMM_TUNING, GemmConfig, fp8_gemm, fp8_gemm_ref, fp8_gemm_wgrad, fp8_gemm_wgrad_ref
from fp8.health import distortion, health_stats, underflow
from fp8.linear import FP8Linear, invalidate_fp8_weight_caches
from fp8.quant import (
    QUANT_TUNING,
    QuantConfig,
    fp8_transpose_128x128,
    quantize_1x128,
    quantize_1x128_dual,
    quantize_1x128_ref,
    quantize_1x128_transposed,
    quantize_128x128,
    quantize_128x128_ref,
)

__all__ = [
    "BLOCK",
    "E4M3",
    "E4M3_MAX",
    "FP8AdamW",
    "FP8Linear",
    "GEMM_TUNING",
    "GemmConfig",
    "QUANT_TUNING",
    "QuantConfig",
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
