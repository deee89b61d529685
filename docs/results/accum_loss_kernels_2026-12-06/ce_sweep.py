"""The chunk epilogue alone at the e64 LM head's chunk (2,048 rows x 157,184, bf16): the compiled (Inductor) form
against the Triton kernels under several launches; do_bench medians, bytes moved at 3 passes (read, read, write)."""
import torch
import triton

from kernels.cross_entropy import CROSS_ENTROPY_TUNING, cross_entropy_grad
from model.loss import _compiled_chunk_grad

g = torch.Generator().manual_seed(0)
c, v = 2048, 157184
logits = (torch.randn(c, v, generator=g) * 3).to("cuda", torch.bfloat16)
target = torch.randint(0, v, (c,), generator=g).cuda()
weight = torch.full((c,), 1.0 / c, device="cuda")
comp = _compiled_chunk_grad()
ref_nll, ref_grad = comp(logits, target, weight)
gb = 3 * c * v * 2 / 1e9
rows = []
ms = triton.testing.do_bench(lambda: comp(logits, target, weight), warmup=25, rep=200)
rows.append(("compiled (Inductor)", ms))
for split, block, warps in [(16384, 2048, 8), (16384, 4096, 8), (8192, 2048, 8), (32768, 4096, 8), (16384, 2048, 4),
                            (16384, 4096, 16), (8192, 1024, 4), (40960, 8192, 16)]:
    with CROSS_ENTROPY_TUNING.override(split=split, block=block, num_warps=warps):
        nll, grad = cross_entropy_grad(logits, target, weight)
        same = (grad == ref_grad).float().mean().item()
        err = (nll - ref_nll).abs().max().item()
        ms = triton.testing.do_bench(lambda: cross_entropy_grad(logits, target, weight), warmup=25, rep=200)
    rows.append((f"kernel split {split} block {block} warps {warps} (same bf16 bits {same:.4f}, nll max diff {err:.2e})", ms))
print("| epilogue, 2048 x 157184 bf16 | ms | GB/s at 3 passes |")
print("|---|---|---|")
for name, ms in rows:
    print(f"| {name} | {ms:.3f} | {gb / ms * 1e3:.0f} |")
