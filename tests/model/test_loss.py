"""The chunked LM-head loss: equal to CE over materialised logits (loss, dh, dW), ignore_index, gradient
scaling, shared weights, no [tokens, vocab] tensor, and the eval / error paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.cross_entropy import cross_entropy_grad_ref
from model.loss import (
    IGNORE_INDEX,
    LOGITS_CHUNK_BYTES,
    cross_entropy,
    default_chunk_size,
    linear_cross_entropy,
    softmax_cross_entropy_grad_fusable,
)


def make_inputs(n=300, hidden=24, vocab=97, ignored=0.2, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(device, dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(device, dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignored] = IGNORE_INDEX
    return h, w, labels.to(device)


def reference(h, w, labels, scale=1.0):
    """Today's path: materialised logits, fp32 CE; returns (loss, dh, dW). With float64 inputs (the "truth" of
    the bf16 tests) the GEMMs run in float64 and the softmax in fp32: ~1e-7, far below bf16's ~4e-3."""
    h, w = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    loss = cross_entropy(F.linear(h, w), labels)
    (scale * loss).backward()
    return loss.detach(), h.grad, w.grad


def fused(h, w, labels, scale=1.0, **kw):
    h, w = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    loss = linear_cross_entropy(h, w, labels, **kw)
    (scale * loss).backward()
    return loss.detach(), h.grad, w.grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


# fp32 on CPU: the chunked maths is the reference's up to summation order (dW sums its chunks in another
# order, the loss sums per-row values) and softmax as exp(z - max) / Σ instead of exp(log_softmax). Measured
# max relative errors (max |Δ| / max |ref|) over 5 seeds x the 6 chunk sizes below: loss 1.7e-7, dh 7.0e-7,
# dW 8.0e-7 (fp32 eps 1.2e-7).
FP32_RTOL = 2e-6


@pytest.mark.parametrize("chunk", [1, 7, 64, 300, 301, None])
def test_matches_materialised_cross_entropy_fp32(chunk):
    h, w, labels = make_inputs()
    ref = reference(h, w, labels)
    out = fused(h, w, labels, chunk_size=chunk)
    for name, a, b in zip(("loss", "dh", "dW"), out, ref):
        assert rel_err(a, b) < FP32_RTOL, (name, chunk, rel_err(a, b))


def test_gradients_scale_with_the_upstream_weight_and_add_over_shared_heads():
    """The MTP head: loss = main + 0.1 · mtp through one weight; dW sums both heads' scaled gradients."""
    h, w, labels = make_inputs(seed=1)
    h2, _, labels2 = make_inputs(seed=2)
    wr = w.detach().requires_grad_(True)
    ref = cross_entropy(F.linear(h.detach(), wr), labels) + 0.1 * cross_entropy(F.linear(h2.detach(), wr), labels2)
    ref.backward()
    wf = w.detach().requires_grad_(True)
    hf = h2.detach().requires_grad_(True)
    loss = linear_cross_entropy(h.detach(), wf, labels, chunk_size=50) \
        + 0.1 * linear_cross_entropy(hf, wf, labels2, chunk_size=64)
    loss.backward()
    assert rel_err(loss, ref) < FP32_RTOL
    assert rel_err(wf.grad, wr.grad) < FP32_RTOL
    _, dh_ref, _ = reference(h2, w, labels2, scale=0.1)
    assert rel_err(hf.grad, dh_ref) < FP32_RTOL
    assert hf.grad.abs().max() > 0


def test_ignored_rows_get_no_gradient_and_all_ignored_gives_zero():
    h, w, labels = make_inputs(ignored=0.5)
    _, dh, _ = fused(h, w, labels, chunk_size=32)
    ignored = labels == IGNORE_INDEX
    assert ignored.any() and (dh[ignored] == 0).all() and (dh[~ignored] != 0).any()
    loss, dh, dw = fused(h, w, torch.full_like(labels, IGNORE_INDEX), chunk_size=32)
    assert loss.item() == 0.0 and (dh == 0).all() and (dw == 0).all()


def test_no_grad_gives_the_same_loss_and_batched_shapes_work():
    h, w, labels = make_inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(h.view(3, 100, -1), w, labels.view(3, 100), chunk_size=33)
    assert rel_err(loss, reference(h, w, labels)[0]) < FP32_RTOL
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, labels[:-1])


def test_frozen_weight_or_input_computes_only_the_needed_gradient():
    h, w, labels = make_inputs()
    _, dh_ref, dw_ref = reference(h, w, labels)
    hd = h.detach().requires_grad_(True)
    linear_cross_entropy(hd, w.detach(), labels, chunk_size=64).backward()
    assert rel_err(hd.grad, dh_ref) < FP32_RTOL
    wd = w.detach().requires_grad_(True)
    linear_cross_entropy(h.detach(), wd, labels, chunk_size=64).backward()
    assert rel_err(wd.grad, dw_ref) < FP32_RTOL


def test_second_backward_fails_clearly():
    h, w, labels = make_inputs()
    loss = linear_cross_entropy(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_bf16_loss_and_gradients_are_as_close_to_the_truth_as_the_materialised_path():
    h, w, labels = make_inputs(n=512, hidden=64, vocab=1000, dtype=torch.bfloat16)
    truth = reference(h.double(), w.double(), labels)
    ref = reference(h, w, labels)
    out = fused(h, w, labels, chunk_size=96)
    for name, a, r, t in zip(("loss", "dh", "dW"), out, ref, truth):
        # both round the logits and the logit gradient to bf16 once; the fused dW sums its chunks in fp32
        # and rounds once, like the single GEMM of the reference. Allow 1.5x the reference's own error.
        assert rel_err(a, t) <= 1.5 * rel_err(r, t) + 1e-6, (name, rel_err(a, t), rel_err(r, t))


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tokens_by_vocab_tensor_exists_in_forward_or_backward():
    n, hidden, vocab, chunk = 2048, 16, 1000, 128
    h, w, labels = make_inputs(n=n, hidden=hidden, vocab=vocab)
    for fn, bound in ((fused, chunk * vocab), (reference, n * vocab)):
        with LargestTensor() as mode:
            fn(h, w, labels, chunk_size=chunk) if fn is fused else fn(h, w, labels)
        if fn is fused:  # the largest is one chunk's logits (dW [V, H] is smaller here)
            assert mode.largest == bound, mode.largest
        else:  # the detector sees the materialised [N, V] logits of the reference
            assert mode.largest >= bound


@pytest.mark.parametrize("epilogue", [cross_entropy_grad_ref, softmax_cross_entropy_grad_fusable])
def test_chunk_epilogue_matches_log_softmax(epilogue):
    logits = torch.randn(37, 501, dtype=torch.float64) * 5
    target = torch.randint(0, 501, (37,))
    weight = torch.rand(37, dtype=torch.float64)
    nll, grad = epilogue(logits, target, weight.float())
    logp = logits.log_softmax(-1)
    torch.testing.assert_close(nll.double(), -logp.gather(1, target[:, None]).squeeze(1), rtol=1e-6, atol=1e-6)
    expected = weight[:, None] * (logp.exp() - F.one_hot(target, 501))
    torch.testing.assert_close(grad, expected.float().double(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fusable_epilogue_gives_the_in_place_one_bit_for_bit(dtype):
    """Eager, both compute the same fp32 expressions (the target's p - w by a select instead of p + (-w) by a
    scatter: the same IEEE result), so the compiled path's source differs from the eager path's in form only."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 3001, generator=g) * 6).to(dtype)
    target = torch.randint(0, 3001, (64,), generator=g)
    weight = torch.rand(64, generator=g) * (torch.rand(64, generator=g) > 0.2)  # some rows ignored (weight 0)
    nll, grad = cross_entropy_grad_ref(logits, target, weight)
    nll_f, grad_f = softmax_cross_entropy_grad_fusable(logits, target, weight)
    assert grad_f.dtype == dtype
    assert torch.equal(nll, nll_f) and torch.equal(grad, grad_f)


def test_default_chunk_size_keeps_a_chunk_of_bf16_logits_under_1_gib():
    assert default_chunk_size(157184) == 2048  # 614 MiB of bf16 logits
    assert default_chunk_size(157184, element_size=4) == 1024
    assert default_chunk_size(257) == 32768  # capped
    for v in (16384, 157184, 262144):  # the largest power of two that fits (8192 hits the cap)
        c = default_chunk_size(v)
        assert c * v * 2 <= LOGITS_CHUNK_BYTES < 2 * c * v * 2, v


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["kernel", "compiled"])
def test_gpu_bf16_fused_matches_materialised_and_bounds_peak_memory(epilogue):
    n, hidden, vocab = 4096, 2048, 157184
    h, w, labels = make_inputs(n=n, hidden=hidden, vocab=vocab, dtype=torch.bfloat16, device="cuda")
    truth = reference(h.double(), w.double(), labels)
    peaks = {}
    results = {}
    for name, fn in (("reference", reference), ("fused", fused)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results[name] = fn(h, w, labels, epilogue=epilogue) if name == "fused" else fn(h, w, labels)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    for i, part in enumerate(("loss", "dh", "dW")):
        err_f, err_r = rel_err(results["fused"][i], truth[i]), rel_err(results["reference"][i], truth[i])
        assert err_f <= 1.5 * err_r + 1e-6, (part, err_f, err_r)
    chunk = default_chunk_size(vocab)
    # fused: dh, dW in fp32 and bf16, one chunk's logits (bf16) + fp32 softmax + bf16 grad; 256 MiB slack
    bound = n * hidden * 2 + vocab * hidden * 6 + chunk * vocab * 8 + 256 * 2**20
    assert peaks["fused"] < bound, (peaks, bound)
    assert peaks["reference"] > 2 * n * vocab * 4  # the materialised path holds fp32 [N, V] tensors


def test_an_unknown_epilogue_is_refused_by_name():
    h, w, labels = make_inputs(n=8)
    with pytest.raises(ValueError, match="epilogue must be one of kernel, compiled, eager, got 'fused'"):
        linear_cross_entropy(h, w, labels, epilogue="fused")
