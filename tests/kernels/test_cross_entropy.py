"""`kernels.cross_entropy.cross_entropy_grad`: the LM-head loss's chunk epilogue as two Triton kernels, against
the float64 log-softmax and against the PyTorch reference, on fresh random logits whose rows span one and many
column splits (with a partial last split), with ignored rows (weight 0: an exact zero gradient), rows whose
largest logit sits in a late split, and bf16 logits; bad input names the problem."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cross_entropy import CROSS_ENTROPY_TUNING, cross_entropy_grad, cross_entropy_grad_ref
from tests.helpers import DEVICES, setup_device


def random_chunk(rows: int, vocab: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[0, -1] = 40.0  # row 0's maximum in the last split: the splits' statistics must be rescaled to it
    target = torch.randint(0, vocab, (rows,), generator=g)
    weight = torch.rand(rows, generator=g) * (torch.rand(rows, generator=g) > 0.25)  # some rows ignored
    return logits.to(dtype), target, weight


def truth(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
    """float64 nll and gradient of the same (rounded) logits."""
    logp = logits.double().log_softmax(-1)
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    grad = weight.double()[:, None] * (logp.exp() - F.one_hot(target, logits.shape[1]))
    return nll, grad


# (rows, vocab) in the interpreter's splits of 256 columns: one partial split, exactly two, several with a partial
# last one, one row
SHAPES = [(5, 100), (9, 512), (6, 1337), (1, 700)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_logits_match_float64_log_softmax(device, shape, request):
    setup_device(device, request)
    rows, vocab = shape
    logits, target, weight = random_chunk(rows, vocab, seed=rows * vocab)
    nll, grad = cross_entropy_grad(logits.to(device), target.to(device), weight.to(device), backend="triton")
    want_nll, want_grad = truth(logits, target, weight)
    assert nll.dtype == torch.float32 and grad.dtype == torch.float32 and grad.shape == (rows, vocab)
    # fp32 maths over a few thousand terms: the same bounds as the reference epilogue's test (tests/model/test_loss.py)
    torch.testing.assert_close(nll.cpu().double(), want_nll, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=1e-5, atol=1e-7)
    ignored = weight == 0
    assert (grad.cpu()[ignored] == 0).all()  # an ignored row's gradient is exactly zero


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits_round_as_the_reference(device, request):
    """The kernel and the reference compute the same fp32 values up to the order of the sum and exp's last bits,
    then round to bf16: their gradients differ by at most one bf16 step (2⁻⁸ relative) where they differ."""
    setup_device(device, request)
    logits, target, weight = random_chunk(7, 1000, seed=11, dtype=torch.bfloat16)
    nll, grad = cross_entropy_grad(logits.to(device), target.to(device), weight.to(device), backend="triton")
    ref_nll, ref_grad = cross_entropy_grad_ref(logits, target, weight)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(nll.cpu(), ref_nll, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.cpu().float(), ref_grad.float(), rtol=2**-8, atol=1e-30)
    assert (grad.cpu() == ref_grad).float().mean() > 0.95  # mostly the same bits


@pytest.mark.parametrize("device", DEVICES)
def test_one_split_per_row_and_strided_rows(device, request):
    """A split wider than the row (one program per row) and a chunk that is a row slice of a wider tensor."""
    setup_device(device, request)
    wide, target, weight = random_chunk(4, 900, seed=5)
    logits = wide[:, :600]  # row stride 900, unit column stride
    with CROSS_ENTROPY_TUNING.override(split=1024, block=128):
        nll, grad = cross_entropy_grad(logits.to(device), target.clamp(max=599).to(device), weight.to(device),
                                       backend="triton")  # fmt: skip
    want_nll, want_grad = truth(logits, target.clamp(max=599), weight)
    torch.testing.assert_close(nll.cpu().double(), want_nll, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=1e-5, atol=1e-7)


def test_bad_input_names_the_problem():
    logits, target, weight = random_chunk(3, 10, seed=1)
    with pytest.raises(ValueError, match="logits must be \\[c, V\\]"):
        cross_entropy_grad(logits.double(), target, weight)
    with pytest.raises(ValueError, match="target must be int64 \\[3\\], got torch.int32"):
        cross_entropy_grad(logits, target.int(), weight)
    with pytest.raises(ValueError, match="row_weight must be float32 \\[3\\]"):
        cross_entropy_grad(logits, target, weight[:2])
    with pytest.raises(ValueError, match="multiple of block"):  # refused when the launch is set, not at a call
        with CROSS_ENTROPY_TUNING.override(split=100, block=64):
            cross_entropy_grad(logits, target, weight, backend="triton")


@pytest.mark.gpu
def test_compiled_kernels_at_the_lm_heads_chunk():
    """The default launch at the e64 model's chunk (2,048 rows × vocabulary 157,184, bf16): against float64."""
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(2048, 157184, generator=g) * 3).to("cuda", torch.bfloat16)
    target = torch.randint(0, 157184, (2048,), generator=g).cuda()
    weight = (torch.rand(2048, generator=g) > 0.1).float().cuda() / 2048
    nll, grad = cross_entropy_grad(logits, target, weight)
    z = logits.double()  # 2.6 GB on the GPU
    want_nll = torch.logsumexp(z, -1) - z.gather(1, target[:, None]).squeeze(1)
    torch.testing.assert_close(nll.double(), want_nll, rtol=1e-5, atol=1e-5)
    del z
    rows = slice(0, 64)  # the float64 gradient of a slice
    want_grad = truth(logits[rows].cpu(), target[rows].cpu(), weight[rows].cpu())[1]
    # bf16 gradient: one rounding of a value within fp32 error of the truth
    torch.testing.assert_close(grad[rows].cpu().double(), want_grad, rtol=2**-8, atol=1e-12)
