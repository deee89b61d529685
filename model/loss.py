"""LM-head losses: the reference cross-entropy over materialised logits, and a chunked linear + cross-entropy
that never holds more than one [chunk, vocab] block of logits (forward and backward in one pass)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cross_entropy import cross_entropy_grad, cross_entropy_grad_ref

IGNORE_INDEX = -100

# A chunk's logits in the compute dtype take at most this many bytes. With bf16 at vocab 157184 that is 2048
# tokens: 614 MiB of bf16 logits; a chunk's peak is about 8 bytes per logit (the bf16 logits, their fp32 softmax
# computed in place, the bf16 gradient) = 2.4 GiB, against 2.6 GB per head for each of the fp32 logits,
# log-probabilities and their gradient over 4096 tokens on the materialised path. A larger chunk means fewer
# read-modify-writes of the fp32 dW [V, H] (one per chunk) and more memory; `bench/bench_model.py --loss-chunks`
# times the sizes side by side (README, "Model forward + backward": 2048 tokens is where the gain flattens).
LOGITS_CHUNK_BYTES = 2**30
MAX_CHUNK_TOKENS = 32768


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over labels != -100, computed in fp32; 0 (with grad) when every label is ignored.

    Summed, then divided by the clamped count (the same value as F.cross_entropy's mean, bit for bit): no
    data-dependent branch, so no host sync in the middle of the forward."""
    logits = logits.float().view(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def default_chunk_size(vocab_size: int, element_size: int = 2) -> int:
    """Tokens per chunk: the largest power of two whose [chunk, vocab] logits fit `LOGITS_CHUNK_BYTES`."""
    tokens = max(1, LOGITS_CHUNK_BYTES // (vocab_size * element_size))
    return min(MAX_CHUNK_TOKENS, 1 << (tokens.bit_length() - 1))


def softmax_cross_entropy_grad_fusable(logits: torch.Tensor, target: torch.Tensor,
                                       row_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.cross_entropy.cross_entropy_grad_ref` written for torch.compile: the same maths and signature,
    without in-place ops.

    The target's −row_weight is subtracted where a column index equals the target (a select, where the eager
    version scatters into its fp32 copy), so Inductor never stores the fp32 logits: on the H200 (torch 2.11) it
    makes one kernel that reads the logits twice (the online softmax, then the gradient) and writes the gradient
    once in the logits' dtype. Eager, this version allocates several fp32 [c, V] temporaries: use it compiled only.
    """
    z = logits.float()
    z_max = z.amax(dim=-1, keepdim=True)
    sum_exp = (z - z_max).exp().sum(dim=-1, keepdim=True)
    nll = (sum_exp.log() - (z.gather(1, target[:, None]) - z_max)).squeeze(1)
    is_target = torch.arange(z.shape[1], device=z.device)[None, :] == target[:, None]
    scale = row_weight[:, None] / sum_exp
    # exp(z - max) is written out again rather than kept from the sum: the form measured, one kernel, no fp32 buffer
    grad = (z - z_max).exp() * scale - torch.where(is_target, row_weight[:, None], 0.0)
    return nll, grad.to(logits.dtype)


# One entry: the chunk epilogue's torch.compile wrapper, built on first use and kept for the process (a wrapper
# per call would compile again every time).
@functools.lru_cache(maxsize=1)
def _compiled_chunk_grad():
    return torch.compile(softmax_cross_entropy_grad_fusable, dynamic=False)


EPILOGUES = ("kernel", "compiled", "eager")  # linear_cross_entropy(epilogue=...)


def _chunk_grad_fn(epilogue: str):
    """The chunk epilogue: "kernel", `kernels.cross_entropy.cross_entropy_grad` (two Triton kernels on CUDA: the
    logits read twice, the gradient written once); "compiled", the fusable form under torch.compile (one Inductor
    kernel); "eager", the in-place PyTorch reference (one fp32 copy of the chunk's logits). Same maths."""
    if epilogue == "kernel":
        return cross_entropy_grad
    if epilogue == "compiled":
        return _compiled_chunk_grad()
    if epilogue == "eager":
        return cross_entropy_grad_ref
    raise ValueError(f"linear_cross_entropy: epilogue must be one of {', '.join(EPILOGUES)}, got {epilogue!r}")


# One entry per device (a handful): whether cuBLAS takes the mixed-dtype in-place addmm there, asked once since
# the probe launches a GEMM.
@functools.lru_cache(maxsize=16)
def _mixed_addmm_in_place(device: torch.device) -> bool:
    """Whether `torch.addmm(acc_fp32, a_bf16, b_bf16, out_dtype=fp32, out=acc)` is accepted here (cuBLAS with
    an fp32 C read and written in place: CUDA in recent torch versions). Asked once per device; reads nothing
    back, so no host sync."""
    acc = torch.zeros(2, 2, device=device)
    a = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _accumulate_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """acc fp32 [V, H] += grad_logitsᵀ [V, c] · h [c, H], the product accumulated in fp32."""
    if grad_logits.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), h)
    elif _mixed_addmm_in_place(acc.device):
        torch.addmm(acc, grad_logits.t(), h, out_dtype=acc.dtype, out=acc)
    else:  # a [V, H] fp32 product per chunk, then added (CPU has no mixed-dtype GEMM)
        acc.add_(torch.mm(grad_logits.t(), h, out_dtype=acc.dtype) if acc.is_cuda
                 else torch.mm(grad_logits.t(), h).float())


def _chunked_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                  need_dh: bool, need_dw: bool, grad_fn):
    """h [N, H], weight [V, H], labels int64 [N] → (mean loss fp32 [], dh [N, H] | None, dW [V, H] | None);
    the gradients are those of the mean loss itself (grad_output 1); grad_fn the chunk epilogue (`_chunk_grad_fn`)."""
    valid = labels != IGNORE_INDEX
    count = valid.sum().clamp(min=1)
    target = torch.where(valid, labels, 0)
    row_weight = valid.float() / count
    nll = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
    for start in range(0, h.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        logits = F.linear(h[rows], weight)
        if not (need_dh or need_dw):
            z = logits.float()
            nll[rows] = torch.logsumexp(z, dim=-1) - z.gather(1, target[rows, None]).squeeze(1)
            continue
        nll[rows], grad_logits = grad_fn(logits, target[rows], row_weight[rows])
        del logits
        if dh is not None:
            torch.mm(grad_logits, weight, out=dh[rows])
        if dw is not None:
            _accumulate_weight_grad(dw, grad_logits, h[rows])
    loss = (nll * valid).sum() / count
    return loss, dh, (dw.to(weight.dtype) if dw is not None else None)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients chunk by chunk; backward only scales them by grad_output
    (e.g. the MTP weight 0.1), in place, and hands them over once."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk_size, grad_fn):
        loss, dh, dw = _chunked_loss(h, weight, labels, chunk_size, ctx.needs_input_grad[0],
                                     ctx.needs_input_grad[1], grad_fn)
        ctx.grads = (dh, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: its gradients were computed in forward and handed out by the "
                               "first backward; backward through it twice (retain_graph) is not supported")
        dh, dw = ctx.grads
        ctx.grads = None
        for g in (dh, dw):
            if g is not None:
                g.mul_(grad_loss)
        return dh, dw, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_size: int | None = None, epilogue: str = "kernel") -> torch.Tensor:
    """Mean CE of logits = h·Wᵀ over labels != -100 (0 when all are ignored), without materialising logits.

    h [..., H] and weight [V, H] in the compute dtype, labels int64 [...] → fp32 scalar. Logits are computed per
    chunk of `chunk_size` tokens (default `default_chunk_size(V)`) in the compute dtype; logsumexp, the target
    logit and the logit gradient in fp32; dW accumulates over chunks in fp32 and is cast to W's dtype once. Equal
    to `cross_entropy(F.linear(h, weight), labels)` up to summation order. `epilogue`, one of EPILOGUES: how each
    chunk's softmax and logit gradient run (`_chunk_grad_fn`; "kernel", the default, is the Triton kernels on
    CUDA and the PyTorch reference elsewhere). No host sync.
    """
    h2 = h.reshape(-1, h.shape[-1])
    labels = labels.reshape(-1)
    if labels.shape[0] != h2.shape[0]:
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} do not match h {tuple(h.shape)}")
    grad_fn = _chunk_grad_fn(epilogue)  # a bad name fails here, before any GEMM
    chunk_size = chunk_size or default_chunk_size(weight.shape[0], weight.element_size())
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h2, weight, labels, chunk_size, grad_fn)
    return _chunked_loss(h2, weight, labels, chunk_size, False, False, grad_fn)[0]


class LMHead(nn.Linear):
    """The bias-free output projection [vocab, hidden]: `head(h)` gives logits, `head(h, labels)` the mean CE
    through `linear_cross_entropy` (no logits). One module call either way, so ZeRO-3 gathers its weight."""

    def __init__(self, hidden_size: int, vocab_size: int, chunk_size: int | None = None) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.chunk_size = chunk_size

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, H] → logits [B, T, V] (labels None) or the mean CE fp32 [] over labels [B, T]."""
        if labels is None:
            return super().forward(h)
        return linear_cross_entropy(h, self.weight, labels, self.chunk_size)
