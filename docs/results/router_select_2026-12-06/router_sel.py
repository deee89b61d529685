# the router's selection: the Triton kernel against the reference (bits) and against today's topk path (time),
# at the step's shapes (run from the repository root as scratch/router_sel.py)
import torch, triton.testing
from kernels.routing import select_experts, select_experts_ref
from tests.kernels.test_routing import three_topk_selection as old_sel
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
rows = []
for n, e, G, TG, K in [(16384, 64, 8, 4, 8), (16384, 256, 8, 4, 8), (4096, 256, 8, 4, 8), (32768, 64, 8, 4, 8)]:
    s = torch.sigmoid(torch.randn(n, e, device=dev, generator=g) * 2)
    b = torch.randn(e, device=dev, generator=g) * 0.05
    a = select_experts(s, b, G, TG, K)
    r = select_experts_ref(s.cpu(), b.cpu(), G, TG, K)
    o = old_sel(s, b, G, TG, K)
    same_ref = torch.equal(a.cpu(), r)
    same_old = torch.equal(a, o)
    t_new = triton.testing.do_bench(lambda: select_experts(s, b, G, TG, K), rep=200)
    t_old = triton.testing.do_bench(lambda: old_sel(s, b, G, TG, K), rep=200)
    t_ref = triton.testing.do_bench(lambda: select_experts_ref(s, b, G, TG, K), rep=200)
    rows.append((f"select {n}x{e}", same_ref, same_old, t_old * 1e3, t_ref * 1e3, t_new * 1e3))
print("| case | kernel == reference (CPU) | kernel == topk path | topk path µs | sort reference µs | kernel µs |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} |")
