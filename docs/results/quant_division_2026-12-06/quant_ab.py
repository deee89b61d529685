"""A/B of the quantizers between two trees: run with cwd = a tree's root.
  python quant_ab.py LABEL SAVE_DIR   -> prints `LABEL name median_us` rows; saves the outputs' used regions
  python quant_ab.py --compare DIR_A DIR_B -> bit comparison of every saved output"""
import os, sys
import torch

def _bits(x):
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16) if x.dtype == torch.bfloat16 else x


if sys.argv[1] == "--compare":
    a, b = sys.argv[2], sys.argv[3]
    for name in sorted(os.listdir(a)):
        ta, tb = torch.load(os.path.join(a, name)), torch.load(os.path.join(b, name))
        parts = []
        for i, (x, y) in enumerate(zip(ta, tb)):
            n = int((_bits(x) != _bits(y)).sum())
            extra = ""
            if n and x.is_floating_point():
                d = (x.float() - y.float()).abs(); extra = f" max|diff| {d.max().item():.3g} rel {(d.norm() / x.float().norm()).item():.3g}"
            parts.append(f"[{i}] {tuple(x.shape)} {x.dtype}: {n} differ{extra}")
        print(f"bits {name}: " + "; ".join(parts))
    sys.exit()

sys.path.insert(0, os.getcwd())
import triton.testing  # noqa: E402
from fp8 import grouped as G  # noqa: E402
from fp8.quant import quantize_1x128, quantize_1x128_transposed, quantize_1x128_dual, quantize_128x128_with_transpose  # noqa: E402
from model.dispatch import plan_dispatch  # noqa: E402

label, save = sys.argv[1], sys.argv[2]
os.makedirs(save, exist_ok=True)
torch.manual_seed(0)
T, E, H, I = 16384, 64, 2048, 512
idx = torch.rand(T, E, device="cuda").topk(8, dim=1).indices
plan = plan_dispatch(idx, E, 16)
rows, src = plan.rows, plan.row_src
used = int(rows.offsets[-1]); blocks = int(rows.block_offsets()[-1])
bf = torch.bfloat16
x = torch.randn(T, H, device="cuda", dtype=bf)
xd = {k: torch.randn(T, k, device="cuda", dtype=bf) * 3 for k in (2048, 3072, 5120)}
x8, x8s = quantize_1x128(xd[2048])
w = torch.randn(5120, 2048, device="cuda", dtype=bf) * 0.02
dh = torch.randn(rows.num_rows, 2 * I, device="cuda", dtype=bf)
h = torch.randn(rows.num_rows, 2 * I, device="cuda", dtype=bf)
h_q, h_s = quantize_1x128(h)
gate = torch.rand(rows.num_rows, device="cuda")
da = torch.randn(rows.num_rows, I, device="cuda", dtype=bf)

def rows_part(t):  # gathered/row outputs: the used rows
    return t[:used]

def tok_part(q, s):  # token-dim outputs: the used blocks
    return q[:, : blocks * 128], s[:, :blocks]

ops = {
    "dense rows [16384,2048]": (lambda: quantize_1x128(xd[2048]), lambda o: o),
    "dense rows [16384,5120]": (lambda: quantize_1x128(xd[5120]), lambda o: o),
    "dense tokens [16384,2048]": (lambda: quantize_1x128_transposed(xd[2048]), lambda o: o),
    "dense tokens [16384,5120]": (lambda: quantize_1x128_transposed(xd[5120]), lambda o: o),
    "dense tokens from fp8 [16384,2048]": (lambda: quantize_1x128_transposed(x8, x8s), lambda o: o),
    "dense dual [16384,3072]": (lambda: quantize_1x128_dual(xd[3072]), lambda o: o),
    "weight 128x128+T [5120,2048]": (lambda: quantize_128x128_with_transpose(w), lambda o: o),
    "grouped rows (gathered x)": (lambda: G.quantize_rows_gathered(x, src, rows), lambda o: (rows_part(o[0]), rows_part(o[1]))),
    "grouped tokens (gathered x)": (lambda: G.quantize_tokens_grouped(x, rows, src), lambda o: tok_part(*o)),
    "grouped tokens (dh)": (lambda: G.quantize_tokens_grouped(dh, rows), lambda o: tok_part(*o)),
    "grouped tokens (SwiGLU a from fp8 h)": (lambda: G.swiglu_quantize_tokens(h_q, h_s, gate, rows), lambda o: tok_part(*o)),
    "swiglu_quantize (save h)": (lambda: G.swiglu_quantize(h, gate, rows, save_h=True), lambda o: tuple(rows_part(t) for t in o)),
    "swiglu_backward": (lambda: G.swiglu_backward(h_q, h_s, da, gate, rows), lambda o: tuple(rows_part(t) for t in o)),
}
for name, (fn, part) in ops.items():
    out = fn(); torch.cuda.synchronize()
    out = out if isinstance(out, tuple) else (out,)
    torch.save(tuple(t.contiguous() for t in part(out)), os.path.join(save, name.replace(" ", "_").replace("/", "_") + ".pt"))
for name, (fn, part) in ops.items():
    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    print(f"ROW {label} | {name} | {ms * 1e3:.1f}", flush=True)
