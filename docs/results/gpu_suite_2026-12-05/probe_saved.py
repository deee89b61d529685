"""scratch: what a dense e64 decoder layer keeps for backward on the GPU (saved tensors by shape/dtype), against
the memory plan, per sub-block; bf16 and fp8."""
import torch
from model.config import ModelConfig
from model.layers import RotaryEmbedding, attention_mask, MLP, swiglu
from model.ling import DecoderLayer
from ling.train.memory_plan import activation_bytes_per_token

tokens = 4096


def saved(run, exclude):
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}
    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip and s.data_ptr() not in seen:
            seen[s.data_ptr()] = (tuple(t.shape), str(t.dtype), s.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, seen


def mem(run):
    torch.cuda.synchronize(); before = torch.cuda.memory_allocated()
    out = run(); out = out[0] if isinstance(out, tuple) else out
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before - out.numel() * out.element_size()


for precision in ("bf16", "fp8"):
    model = ModelConfig.preset("ling_mini_2_0_e64", precision=precision)
    per = activation_bytes_per_token(model, 2, tokens)
    rotary = RotaryEmbedding(model.rotary_dim, model.rope_base).cuda()
    cos, sin = rotary.cos_sin(torch.arange(tokens, device="cuda"))
    doc_ids = torch.repeat_interleave(torch.arange(4, device="cuda"), tokens // 4)[None]
    mask = attention_mask(doc_ids, model)
    layer = DecoderLayer(model, moe=False).cuda().to(torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    x = torch.randn(1, tokens, model.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for i in range(2):
        out, seen = saved(lambda: layer(x, cos, sin, mask), list(layer.parameters()) + [x])
        kept = mem(lambda: layer(x, cos, sin, mask))
    print(f"== {precision}: dense layer kept {kept / tokens:.0f} B/token; plan attention+dense_mlp - x = "
          f"{per['attention'] + per['dense_mlp'] - model.hidden_size * 2:.0f}; attention {per['attention']:.0f} dense_mlp {per['dense_mlp']:.0f}")
    tot = 0
    for ptr, (shape, dt, nb) in seen.items():
        tot += nb
        print(f"   saved {shape} {dt} {nb / tokens:.1f} B/token")
    print(f"   saved total {tot / tokens:.0f} B/token")
    # the MLP alone, and the compiled SwiGLU alone
    h = torch.randn(1, tokens, model.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for i in range(2):
        out, seen = saved(lambda: layer.mlp(h) if hasattr(layer, "mlp") else None, list(layer.parameters()) + [h])
    print("   MLP alone:", [(s, d, round(n / tokens, 1)) for s, d, n in seen.values()],
          "kept", mem(lambda: layer.mlp(h)) / tokens)
    gu = torch.randn(tokens, 2 * model.dense_intermediate_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for compiled in (False, True):
        for i in range(2):
            out, seen = saved(lambda: swiglu(gu, False, compiled), [gu])
        print(f"   swiglu compiled={compiled}: extra saved", [(s, d, round(n / tokens, 1)) for s, d, n in seen.values()],
              "kept", mem(lambda: swiglu(gu, False, compiled)) / tokens)
    del layer
