"""`fp8.expert_wgrad`: the FP8 routed experts' weight gradients from bf16 operands (`wgrad="bf16"`) beside the
blockwise recipe's E4M3 ones (`wgrad="fp8"`, the default). The bf16 dW against a float64 product of the same
operands, against the exact experts' gradient (closer than the FP8 wgrad), bit-identical with and without routing-
map padding; dx and the gate gradients bit-identical between the two; the default bit-identical to the recipe
composed by hand; the config key validated, carried to the experts and trained with. CPU (the torch reference, and
Triton's interpreter where marked); the `gpu` tests run torch._grouped_mm and the compiled kernels (the
no-host-sync check of the bf16 wgrad is in tests/model/test_moe_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from fp8.grouped import (
    fp8_grouped_experts,
    grouped_gemm,
    grouped_gemm_wgrad,
    grouped_wgrad_bf16,
    quantize_expert_weights,
    quantize_rows_gathered,
    quantize_tokens_grouped,
    swiglu_backward,
    swiglu_output,
    swiglu_quantize,
    swiglu_quantize_tokens,
)
from fp8.quant import dequantize_1x128, fp8_transpose_128x128, quantize_1x128
from kernels.rows import gather_rows
from model.dispatch import plan_dispatch
from model.moe import GroupedExperts, MoE
from tests.helpers import compose_cfg, data_rows, layout, rel

EMPTY = (0, 3)  # experts that get no token


def case(seed: int, dtype=torch.float32, device="cpu", t=96, e=8, k=2, h=256, inter=128):
    """Tokens, routing (experts EMPTY get none), gates, expert weights and the output gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    logits[:, list(EMPTY)] -= 100
    topk_idx = logits.topk(k, dim=-1).indices
    gates = torch.rand(t, k, generator=g) + 0.1
    w_gu = torch.randn(e, 2 * inter, h, generator=g) * 0.05
    w_d = torch.randn(e, h, inter, generator=g) * 0.05
    dout = torch.randn(t, h, generator=g)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), topk_idx.to(device), cast(gates), cast(w_gu), cast(w_d), cast(dout)


def run(c, wgrad: str | None, pad: int = 16):
    """fp8_grouped_experts forward + backward → (out, dx, d_gates, dW_gate_up, dW_down); wgrad None: the default."""
    x, topk_idx, gates, w_gu, w_d, dout = c
    plan = plan_dispatch(topk_idx, w_gu.shape[0], pad)
    x, gates, w_gu, w_d = (t.clone().requires_grad_(True) for t in (x, gates, w_gu, w_d))
    wq = (*quantize_expert_weights(w_gu.detach()), *quantize_expert_weights(w_d.detach()))
    kw = {} if wgrad is None else {"wgrad": wgrad}
    out = fp8_grouped_experts(x, gates, w_gu, w_d, wq, plan.row_src, plan.pos, plan.rows, **kw)
    out.backward(dout)
    return [out.detach(), x.grad, gates.grad, w_gu.grad, w_d.grad]


def path_operands(c, pad: int = 16):
    """What the experts' backward computes before its wgrad, composed from the public ops: (plan, FP8 h, its
    scales, the row gates, dh [M, 2I])."""
    x, topk_idx, gates, w_gu, w_d, dout = c
    plan = plan_dispatch(topk_idx, w_gu.shape[0], pad)
    rows, row_src = plan.rows, plan.row_src
    gu_q, gu_s = quantize_expert_weights(w_gu)
    d_q, d_s = quantize_expert_weights(w_d)
    row_gate = torch.zeros(rows.num_rows).scatter_(0, plan.pos.reshape(-1).long(), gates.reshape(-1).float())
    h = grouped_gemm(*quantize_rows_gathered(x, row_src, rows), gu_q, gu_s, rows, out_dtype=x.dtype)
    _, _, h_q, h_s = swiglu_quantize(h, row_gate, rows)
    da = grouped_gemm(*quantize_rows_gathered(dout, row_src, rows), *fp8_transpose_128x128(d_q, d_s), rows,
                      out_dtype=x.dtype)  # fmt: skip
    dh = swiglu_backward(h_q, h_s, da, row_gate, rows)[0]
    return plan, h_q, h_s, row_gate, dh


# Tolerances against float64 of the same operands: fp32 — fp32 accumulation and a's fp32 SwiGLU (1e-5); bf16 — a
# rounded to bf16 and dW's bf16 output rounding (8 significant bits, ~1.1e-3 rms each: 4e-3).
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_wgrad_is_the_float64_product_of_the_paths_own_operands(dtype):
    c = case(0, dtype)
    x, dout = c[0], c[5]
    plan, h_q, h_s, row_gate, dh = path_operands(c)
    got = run(c, "bf16")
    h = dequantize_1x128(h_q, h_s, torch.float64)
    inter = h.shape[1] // 2
    a = F.silu(h[:, :inter]) * h[:, inter:] * row_gate.double()[:, None]  # the gated SwiGLU output, float64
    dy, xr = gather_rows(dout, plan.row_src).double(), gather_rows(x, plan.row_src).double()
    segments = plan.rows.host_segments()
    for e, (lo, hi) in enumerate(segments):
        dw_gu, dw_d = got[3][e], got[4][e]
        assert dw_gu.dtype == dw_d.dtype == dtype
        if e in EMPTY:
            assert hi == lo and not dw_gu.any() and not dw_d.any()  # an expert without tokens: exact zeros
            continue
        assert rel(dw_d, dy[lo:hi].t() @ a[lo:hi]) < TOL[dtype]
        assert rel(dw_gu, dh[lo:hi].double().t() @ xr[lo:hi]) < TOL[dtype]


def test_default_is_the_blockwise_recipe_bit_for_bit():
    """wgrad="fp8" (and no argument) is the recipe's wgrad composed by hand: E4M3 operands quantized 1x128 along
    the tokens per segment, the grouped FP8 wgrad GEMM."""
    c = case(1)
    x, dout = c[0], c[5]
    plan, h_q, h_s, row_gate, dh = path_operands(c)
    rows = plan.rows
    want_d = grouped_gemm_wgrad(*quantize_tokens_grouped(dout, rows, plan.row_src),
                                *swiglu_quantize_tokens(h_q, h_s, row_gate, rows), rows)  # fmt: skip
    want_gu = grouped_gemm_wgrad(*quantize_tokens_grouped(dh, rows),
                                 *quantize_tokens_grouped(x, rows, plan.row_src), rows)  # fmt: skip
    for got in (run(c, None), run(c, "fp8")):
        assert torch.equal(got[3], want_gu) and torch.equal(got[4], want_d)


def test_bf16_wgrad_is_closer_to_the_exact_gradient_than_the_fp8_wgrad():
    """Against the float64 gradient of the unquantized experts, both wgrads carry the forward and dgrad's E4M3
    errors (h from FP8 x and W, dh from FP8 dy and W: ~6 % norm-relative); the FP8 wgrad adds two more E4M3
    roundings (dy or dh, and a or x). Measured over these seeds: bf16 0.061-0.067, fp8 0.068-0.073, ratio
    0.89-0.91; bound: bf16 below 0.95x fp8 for both weights."""
    for seed in range(3):
        c = case(10 + seed)
        x, topk_idx, gates, w_gu, w_d, dout = (t.double() if t.is_floating_point() else t for t in c)
        x, gates, w_gu, w_d = (t.clone().requires_grad_(True) for t in (x, gates, w_gu, w_d))
        inter = w_d.shape[2]
        out = 0
        for j in range(topk_idx.shape[1]):
            h = torch.einsum("th,tnh->tn", x, w_gu[topk_idx[:, j]])
            a = F.silu(h[:, :inter]) * h[:, inter:]
            out = out + gates[:, j : j + 1] * torch.einsum("ti,thi->th", a, w_d[topk_idx[:, j]])
        out.backward(dout)
        fp8, bf16 = run(c, "fp8"), run(c, "bf16")
        for i, exact in ((3, w_gu.grad), (4, w_d.grad)):
            assert rel(bf16[i], exact) < 0.95 * rel(fp8[i], exact), (seed, i)


def test_only_the_weight_gradients_change():
    c = case(2)
    fp8, bf16 = run(c, "fp8"), run(c, "bf16")
    for i in range(3):  # output, dx, d_gates: the same bits
        assert torch.equal(fp8[i], bf16[i])
    for i in (3, 4):
        assert not torch.equal(fp8[i], bf16[i])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_changes_no_bit_of_any_gradient(backend, monkeypatch, request):
    """Pad rows read dy = 0 and x = 0 and have gate 0 (a = 0, dh = 0); the reference loop leaves them out of the
    matmuls. "triton": the FP8 kernels and the gather in Triton's interpreter."""
    if backend == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs Triton's interpreter on CPU")
        request.getfixturevalue("triton_interpreter")
        monkeypatch.setenv("LING_FP8_BACKEND", "triton")
    c = case(3, t=40, e=8, h=128)
    for u, v in zip(run(c, "bf16", pad=1), run(c, "bf16", pad=16)):
        assert torch.equal(u, v)


def test_grouped_wgrad_ignores_rows_past_the_segments_and_checks_its_operands():
    rows, segs = layout([0, 37, 5, 0, 130, 16], 16, "cpu")
    a, b = data_rows(segs, rows.num_rows, 256, "cpu"), data_rows(segs, rows.num_rows, 128, "cpu")
    a[int(rows.offsets[-1]):] = float("nan")  # unused rows hold garbage (the kernels leave them unwritten)
    out = grouped_wgrad_bf16(a, b, rows, torch.float32)
    for e, (lo, hi) in enumerate(segs):
        assert torch.equal(out[e], a[lo:hi].t() @ b[lo:hi]) if hi > lo else not out[e].any()
    with pytest.raises(TypeError, match="share a dtype"):
        grouped_wgrad_bf16(a, b.bfloat16(), rows, torch.float32)
    with pytest.raises(ValueError, match="num_rows"):
        grouped_wgrad_bf16(a[:-1], b[:-1], rows, torch.float32)


def test_compiled_swiglu_output_rounds_as_eager():
    """The a-recompute through Inductor (its CPU backend here; the GPU's in the gpu test): bf16, the training dtype,
    bit for bit (`emulate_precision_casts`; the fp32 chain fuses without reordering a sum)."""
    torch.manual_seed(4)
    h_q, h_s = quantize_1x128(torch.randn(48, 256) * 3)
    gate = torch.rand(48)
    assert torch.equal(swiglu_output(h_q, h_s, gate, torch.bfloat16, compiled=True),
                       swiglu_output(h_q, h_s, gate, torch.bfloat16))  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- config
def test_config_key_is_validated_and_reaches_the_experts():
    from ling.config import model_config_from

    base = ["+exp=tiny_cpu", "data=synthetic", "precision=fp8"]
    assert model_config_from(compose_cfg(base), 256).fp8_expert_wgrad == "fp8"  # the recipe by default
    cfg = compose_cfg([*base, "fp8.expert_wgrad=bf16"])
    mc = model_config_from(cfg, 256)
    assert mc.fp8_expert_wgrad == "bf16"
    with pytest.raises(ValueError, match=r"model.fp8_expert_wgrad: \(config key fp8.expert_wgrad\) must be one of "
                                         r"fp8, bf16, got 'fp16'"):  # fmt: skip
        model_config_from(compose_cfg([*base, "fp8.expert_wgrad=fp16"]), 256)
    with pytest.raises(ValueError, match="wgrad must be one of fp8, bf16"):
        run(case(0), "e4m3")
    # through the MoE layer: the same output, dx and router/shared-expert gradients; other expert gradients
    torch.manual_seed(5)
    small = dict(vocab_size=64, hidden_size=128, expert_intermediate_size=128, precision="fp8")
    recipe, option = MoE(mc.replace(**small, fp8_expert_wgrad="fp8")), MoE(mc.replace(**small))
    assert {m.wgrad for m in option.modules() if isinstance(m, GroupedExperts)} == {"bf16"}
    for p in recipe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    option.load_state_dict(recipe.state_dict())
    x, g = torch.randn(2, 24, 128), torch.randn(2, 24, 128)
    grads = []
    for moe in (recipe, option):
        xi = x.clone().requires_grad_(True)
        (moe(xi)[0] * g).sum().backward()
        grads.append({"x": xi.grad, **{n: p.grad for n, p in moe.named_parameters()}})
    for name in grads[0]:
        same = torch.equal(grads[0][name], grads[1][name])
        assert same != name.startswith("experts."), name


@pytest.mark.slow
def test_tiny_model_trains_with_the_bf16_expert_wgrad(tmp_path):
    """The trainer with fp8.expert_wgrad=bf16: the experts run it, the health hook samples them, the losses stay
    finite, and the first step's loss is the recipe's (the forward is the same) while training then departs."""
    import json

    from ling.train.engine import build_engine
    from ling.train.trainer import train

    engines = []
    losses = {}
    for wgrad in ("fp8", "bf16"):
        cfg = compose_cfg(["+exp=tiny_cpu", "data=synthetic", "precision=fp8", "optim=fp8_adamw", "train.steps=3",
                           "train.seq_len=32", "model.num_layers=2", "logging.wandb.mode=disabled",
                           "logging.progress_bar=false", "train.save_final=false", "optim.warmup_steps=1",
                           "optim.lr=1e-2", "train.resume=none", "fp8.health_every=2",
                           f"fp8.expert_wgrad={wgrad}"])  # fmt: skip
        run_dir = tmp_path / wgrad
        last = train(cfg, run_dir=run_dir, build_engine=lambda *a: engines.append(build_engine(*a)) or engines[-1])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[wgrad] = [r["loss"] for r in rows]
        assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in rows)
        experts = [m for m in engines[-1][0].module.modules() if isinstance(m, GroupedExperts)]
        assert experts and all(m.fp8 and m.wgrad == wgrad for m in experts)
        assert any(k.startswith("fp8/") and ".experts/" in k for k in last)  # the health hook's statistics
    assert losses["fp8"][0] == losses["bf16"][0]
    assert losses["fp8"][1:] != losses["bf16"][1:]
    assert all(torch.isfinite(torch.tensor(losses["bf16"])))


# ---------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_grouped_mm_wgrad_matches_the_loop_with_empty_experts_pad_and_unused_rows():
    """torch._grouped_mm (2-D × 2-D, offs along the rows) against the fp32 loop on the same CUDA tensors: empty
    segments exact zeros, unused rows past the last offset (NaN here) ignored, pad rows zero. bf16 output: 8
    significant bits, bound 4e-3 norm-relative per expert."""
    torch.manual_seed(6)
    rows, segs = layout([0, 37, 5, 0, 130, 1, 64, 16, 0, 261], 16, "cuda")
    for n, k in ((2048, 512), (1024, 2048)):  # down and gate_up at Ling's shapes (H 2048, I 512)
        a = torch.zeros(rows.num_rows, n, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(rows.num_rows, k, device="cuda", dtype=torch.bfloat16)
        for lo, hi in segs:
            a[lo:hi], b[lo:hi] = torch.randn(hi - lo, n), torch.randn(hi - lo, k)
        a[int(rows.offsets[-1]):] = float("nan")
        b[int(rows.offsets[-1]):] = float("nan")
        out = grouped_wgrad_bf16(a, b, rows, torch.bfloat16)
        ref = grouped_wgrad_bf16(a, b, rows, torch.float32, backend="torch")
        assert out.dtype == torch.bfloat16 and out.shape == (len(segs), n, k)
        for e, (lo, hi) in enumerate(segs):
            if hi == lo:
                assert not out[e].any()
            else:
                assert rel(out[e], ref[e]) < 4e-3


@pytest.mark.gpu
def test_experts_with_the_bf16_wgrad_on_gpu_match_the_reference_and_padding():
    """The whole experts' function on CUDA (Triton kernels, compiled a-recompute, torch._grouped_mm) against the
    CPU reference on the same bf16 inputs: FP8 kernels and reference agree up to fp32 summation order, except
    where a recomputed value lands across an E4M3 rounding boundary; dW from bf16 operands: bound 1e-2
    norm-relative. With and without padding: zero rows add exact zeros (expected bit-identical)."""
    c = case(7, torch.bfloat16, "cuda", t=1024, e=16, h=512, inter=256)
    gpu = run(c, "bf16")
    cpu = run([t.cpu() for t in c], "bf16")
    for u, v in zip(gpu, cpu):
        assert rel(u, v) < 1e-2
    for u, v in zip(gpu, run(c, "bf16", pad=1)):
        assert torch.equal(u, v)
