"""`model.compile_ops`: every function compiled by torch.compile (through Inductor's CPU backend here, `on`) against
its eager self, forward and backward, on fresh random inputs; the tiny model compiled against eager under every
recompute mode; one compiled graph per input shape whatever the number of layers, and no graph break.

Tolerances. fp32: Inductor fuses the chains and vectorises their reductions (RMSNorm's mean of squares, the
router's row sums, the backward's sums over rows), so the summation order — and the last bits — differ from
eager's: measured worst errors 1e-7 to 3e-7 relative to each tensor's largest magnitude (one or two fp32 ulps),
1.3e-6 on the model's gradients; the bound, 1e-5 of the largest magnitude, sits well above that and far below
any real mistake (a wrong eps, a missing cast or a dropped term moves results by >= 1e-3). bf16: the compiled
functions round where eager does (`emulate_precision_casts`), so outputs differ at most where a reordered fp32
sum lands on the other side of a bf16 rounding: bound one bf16 ulp (2^-8) of the largest magnitude; measured
bit-identical on these inputs. Integer results (expert choices, counts, the dispatch plan) are compared exactly."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from model.config import ModelConfig
from model.dispatch import plan_dispatch, plan_rows
from model.layers import Fusable, _swiglu, qk_norm_rope, rms_norm, swiglu, use_compiled
from model.ling import LingForCausalLM
from model.moe import route
from tests.helpers import dynamo_graphs

RTOL = 1e-5  # see the module docstring


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> bool:
    """|a − b| <= rtol · max|b| everywhere (exact for integer tensors)."""
    if not b.is_floating_point():
        return torch.equal(a, b)
    return bool((a - b).abs().max() <= rtol * b.abs().max().clamp(min=1e-30))


def fwd_bwd(fn, inputs: list[torch.Tensor], consts: tuple, compiled: bool, seed: int = 0):
    """fn(*inputs, *consts) → (outputs, grads of Σ outputs · fixed random weights w.r.t. the float inputs)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves, *consts, compiled=compiled)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs if o.requires_grad)
    diff = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(loss, diff, allow_unused=True)  # the router's bias: no gradient (selection only)
    return [o.detach() for o in outs], [torch.zeros_like(t) if d is None else d for t, d in zip(diff, grads)]


def check_compiled_matches_eager(fused: Fusable, fn, inputs, consts=(), rtol: float = RTOL):
    """fn (`fused` or a wrapper of it) compiled vs eager: outputs and input gradients."""
    eager_out, eager_grads = fwd_bwd(fn, inputs, consts, compiled=False)
    graphs = dynamo_graphs(fused)
    out, grads = fwd_bwd(fn, inputs, consts, compiled=True)
    assert dynamo_graphs(fused) == graphs + 1  # it did compile (a new shape)
    assert len(out) == len(eager_out) and len(grads) == len(eager_grads)
    for i, (a, b) in enumerate(zip(out + grads, eager_out + eager_grads)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert close(a, b, rtol), (fn.__name__, i, float((a.double() - b.double()).abs().max()))


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_use_compiled_follows_compile_ops_and_the_device():
    x = torch.zeros(1)
    assert use_compiled("on", x) and not use_compiled("off", x) and not use_compiled("auto", x)
    with pytest.raises(ValueError, match="model.compile_ops"):
        ModelConfig.preset("tiny", compile_ops="yes")


DTYPES = pytest.mark.parametrize("dtype, rtol", [(torch.float32, RTOL), (torch.bfloat16, 2**-8)])


@DTYPES
def test_rms_norm_compiled_matches_eager(dtype, rtol):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 20, 96, generator=g) * 3).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    check_compiled_matches_eager(rms_norm, rms_norm, [x, w], (1e-6,), rtol)


@DTYPES
def test_qk_norm_rope_compiled_matches_eager(dtype, rtol):
    g = torch.Generator().manual_seed(2)
    B, T, hq, hkv, d = 2, 20, 4, 2, 32
    qkv = torch.randn(B, T, (hq + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = torch.rand(T, 16, generator=g), torch.rand(T, 16, generator=g)  # fp32, as the model's
    gains = [(torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2)]

    def fn(qkv, q_gain, k_gain, cos, sin, eps, compiled):  # the model's views of the fused QKV output
        q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(B, T, hq, d).transpose(1, 2)
        k = k.view(B, T, hkv, d).transpose(1, 2)
        return qk_norm_rope(q, k, q_gain, k_gain, cos, sin, eps, compiled=compiled)

    check_compiled_matches_eager(qk_norm_rope, fn, [qkv, *gains, cos, sin], (1e-6,), rtol)


def test_router_compiled_matches_eager_choices_exactly():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=g)
    weight = torch.randn(16, 48, generator=g) * 0.2
    bias = torch.randn(16, generator=g) * 0.05  # a nonzero bias: selection differs from the gates' ranking
    consts = (4, 2, 4, 2.5)  # groups, groups kept, top-k, scaling
    check_compiled_matches_eager(route, route, [x, weight, bias], consts)
    idx, _, _, _, counts = route(x, weight, bias, *consts, compiled=True)
    assert counts.sum() == idx.numel() and idx.dtype == torch.int64


@pytest.mark.parametrize("pad", [1, 16])
def test_dispatch_plan_compiled_is_exactly_eager(pad):
    g = torch.Generator().manual_seed(4)
    scores = torch.rand(50, 16, generator=g)
    scores[:, :3] -= 2  # three experts get no token
    topk_idx = scores.topk(4, dim=-1).indices
    eager, compiled = plan_dispatch(topk_idx, 16, pad), plan_dispatch(topk_idx, 16, pad, compiled=True)
    for name in ("row_src", "pos", "tokens_per_expert", "pad_token", "num_pad"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    assert torch.equal(compiled.rows.offsets, eager.rows.offsets) and compiled.rows.num_rows == eager.rows.num_rows


@DTYPES
@pytest.mark.parametrize("recompute", [False, True])
def test_swiglu_compiled_matches_eager(recompute, dtype, rtol):
    gate_up = torch.randn(2, 20, 256, generator=torch.Generator().manual_seed(5)).to(dtype)
    check_compiled_matches_eager(_swiglu, lambda t, compiled: swiglu(t, recompute, compiled), [gate_up], rtol=rtol)


# ---------------------------------------------------------------- the model
def _ids(seed=7):
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, 257, (2, 24), generator=g), torch.randint(0, 257, (2, 24), generator=g)
    return ids, labels, torch.tensor([[0] * 10 + [1] * 14, [0] * 24])


def _run(compile_ops: str, recompute: str):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=257, compile_ops=compile_ops, recompute=recompute, pad_for_fp8=True)
    model = LingForCausalLM(cfg).train()
    ids, labels, doc_ids = _ids()
    out = model(ids, labels=labels, doc_ids=doc_ids)
    out.loss.backward()
    counts = torch.stack([r.tokens_per_expert for r in model.routers()])
    return out, {n: p.grad for n, p in model.named_parameters()}, counts


FUSED = {"rms_norm": rms_norm, "qk_norm_rope": qk_norm_rope, "route": route, "plan_rows": plan_rows,
         "swiglu": _swiglu}


@pytest.fixture(scope="module")
def compiled_runs():
    """compile_ops=on for each recompute mode, the graphs counted after the first (no recompute) run."""
    torch._dynamo.reset()
    counters.clear()
    runs = {"none": _run("on", "none")}
    graphs = {name: dynamo_graphs(fn) for name, fn in FUSED.items()}
    runs.update({mode: _run("on", mode) for mode in ("full", "selective")})
    return runs, graphs, dict(counters["graph_break"])


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_tiny_model_compiled_matches_eager(compiled_runs, recompute):
    out, grads, counts = compiled_runs[0][recompute]
    ref, ref_grads, ref_counts = _run("off", recompute)
    # the loss sums many fp32 terms: the reordered norms move it by an ulp or two at most
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) <= RTOL * float(ref.loss.detach())
    assert close(out.z_loss, ref.z_loss) and close(out.mtp_loss, ref.mtp_loss)
    assert torch.equal(counts, ref_counts)  # the same experts chosen, counted once per micro-batch
    for name, g in ref_grads.items():
        assert close(grads[name], g), (name, float((grads[name] - g).abs().max() / g.abs().max()))


@pytest.mark.slow
def test_one_graph_per_shape_serves_every_layer_without_graph_breaks(compiled_runs):
    """3 decoder layers + 1 MTP layer: 10 RMSNorms, 4 attention cores, 3 routers and dispatch plans — each
    function compiled once (the SwiGLU twice: the dense MLP's and the shared expert's widths), and the
    recomputing modes reuse those graphs (their own: the selective SwiGLU's recompute flag) — and no graph break,
    which also rules out a host sync inside them (.item() and data-dependent shapes break dynamo's graphs)."""
    _, graphs, graph_breaks = compiled_runs
    assert graphs == {"rms_norm": 1, "qk_norm_rope": 1, "route": 1, "plan_rows": 1, "swiglu": 2}
    assert graph_breaks == {}
    assert dynamo_graphs(rms_norm) == 1 and dynamo_graphs(route) == 1  # full and selective recompute: no new graph
