"""scratch: the compiled SwiGLU's saved tensors on CPU, fresh and after dynamo's recompile limit."""
import torch
from model.layers import swiglu


def saved_bytes(fn):
    seen = {}
    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(v for k, v in seen.items()), out


gu = torch.randn(256, 2 * 320, dtype=torch.bfloat16, requires_grad=True)
print("fresh, compiled: saved", saved_bytes(lambda: swiglu(gu, False, True))[0], "bytes (gate_up itself:",
      gu.numel() * 2, ")")
for width in range(1, 10):
    swiglu(torch.randn(8, 2 * 16 * width, requires_grad=True), False, True).sum().backward()
gu2 = torch.randn(256, 2 * 336, dtype=torch.bfloat16, requires_grad=True)
print("new shape after nine others, compiled: saved", saved_bytes(lambda: swiglu(gu2, False, True))[0],
      "bytes (gate_up:", gu2.numel() * 2, "; silu(gate):", 256 * 336 * 2, ")")
print("same shape, eager: saved", saved_bytes(lambda: swiglu(gu2, False, False))[0])
