"""The LM-head loss's kernels, one call at 16,384 tokens x vocab 157,184 (bf16): GPU time by kernel (profiler)."""
import torch
from torch.profiler import ProfilerActivity, profile

from model.loss import linear_cross_entropy

n, hidden, vocab = 16384, 2048, 157184
g = torch.Generator().manual_seed(1)
h = (torch.randn(n, hidden, generator=g)).cuda().bfloat16().requires_grad_(True)
w = (torch.randn(vocab, hidden, generator=g) * 0.02).cuda().bfloat16().requires_grad_(True)
labels = torch.randint(0, vocab, (n,), generator=g).cuda()
for _ in range(3):
    linear_cross_entropy(h, w, labels).backward()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        loss = linear_cross_entropy(h, w, labels)
        loss.backward()
    torch.cuda.synchronize()
rows = {}
for e in prof.key_averages():
    if e.device_time_total > 0:
        rows[e.key] = e.device_time_total / 5 / 1e3
total = sum(rows.values())
for k, v in sorted(rows.items(), key=lambda kv: -kv[1])[:8]:
    print(f"  {v:8.2f} ms  {k[:100]}")
print(f"  total {total:.2f} ms per call; loss {loss.item():.6f}; |dh| {h.grad.float().norm().item():.6f}")
