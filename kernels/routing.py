"""The router's expert selection, group-limited top-k, as one Triton kernel with its PyTorch reference.

Selection (DeepSeek-V3's and Ling's): the biased scores v = score + expert_bias; a group's score is the sum of its
two largest v; the `topk_groups` best groups are kept; the `top_k` largest v inside them are the token's experts,
largest first. Ties rank the lower index first (the reference sorts stably), and NaN ranks above every number (as
in `torch.sort` / `torch.topk`), so the kernel and the reference choose the same experts in the same order bit for
bit. On CUDA the kernel replaces three `topk` calls, two sorts and the masks between them (its timings:
docs/benchmarks.md, seventh session).
"""

from __future__ import annotations

import torch

from kernels.backend import HAS_TRITON, cdiv, tl, triton, use_triton

__all__ = ["select_experts", "select_experts_ref"]

# scores held by one program of the kernel (rows x the experts padded to a power of two)
_VALUES_PER_PROGRAM = 2048


# ----------------------------------------------------------------------------------------------------------
# Reference (CPU path and tests)
# ----------------------------------------------------------------------------------------------------------
def select_experts_ref(
    scores: torch.Tensor, expert_bias: torch.Tensor, num_groups: int, topk_groups: int, top_k: int
) -> torch.Tensor:
    """scores fp32 [N, E], expert_bias fp32 [E] -> int64 [N, top_k]: the top-k biased scores inside the top
    `topk_groups` groups (a group's score: the sum of its top-2 biased scores), largest first, ties to the lower
    index."""
    n = scores.shape[0]
    biased = scores + expert_bias
    grouped = biased.view(n, num_groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]; the top-2 values, whatever their order
    group_idx = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, :topk_groups]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, -1)
    masked = biased.masked_fill(~expert_mask, float("-inf"))
    return masked.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _take_largest(v, available, idx):
        """The largest available value of each row of v [R, C] (ties: the lowest index; idx [C] the column
        indices): (that value [R], its column [R], `available` without it)."""
        m = tl.max(tl.where(available, v, float("-inf")), 1)
        col = tl.min(tl.where(available & (v == m[:, None]), idx[None, :], v.shape[1]), 1)
        return m, col, available & (idx[None, :] != col[:, None])

    @triton.jit
    def _select_experts_kernel(
        s_ptr, b_ptr, out_ptr, N, stride_sn, stride_se, stride_on, stride_ok,
        E: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One block of BLOCK_N tokens: their scores [BLOCK_N, E] in, their experts int64 [BLOCK_N, TOP_K] out."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_E)
        r_ok = rows < N
        c_ok = cols < E
        s = tl.load(s_ptr + rows[:, None] * stride_sn + cols[None, :] * stride_se, mask=r_ok[:, None] & c_ok[None, :],
                    other=0.0)  # fmt: skip
        v = s + tl.load(b_ptr + cols, mask=c_ok, other=0.0)[None, :]
        v = tl.where(v != v, float("inf"), v)  # NaN ranks above every number (scores are finite otherwise)
        col_group = cols // (E // NUM_GROUPS)
        gcols = tl.arange(0, BLOCK_G)

        # a group's score: its two largest values (the first maximum taken out, then the next)
        group_scores = tl.full((BLOCK_N, BLOCK_G), float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_g = (col_group == g)[None, :] & c_ok[None, :]
            m1, _, rest = _take_largest(v, in_g, cols)
            m2 = tl.max(tl.where(rest, v, float("-inf")), 1)
            group_scores = tl.where(gcols[None, :] == g, (m1 + m2)[:, None], group_scores)

        # the TOPK_GROUPS best groups, and their experts
        groups_left = (gcols < NUM_GROUPS)[None, :] & r_ok[:, None]
        experts_left = tl.zeros((BLOCK_N, BLOCK_E), tl.int32) != 0
        for _ in tl.static_range(TOPK_GROUPS):
            _, group, groups_left = _take_largest(group_scores, groups_left, gcols)
            experts_left = experts_left | (col_group[None, :] == group[:, None])
        # masked experts rank as -inf, after every kept one, like the reference's masked_fill
        v = tl.where(experts_left, v, float("-inf"))
        experts_left = c_ok[None, :] & r_ok[:, None]

        kcols = tl.arange(0, BLOCK_K)
        out = tl.zeros((BLOCK_N, BLOCK_K), tl.int64)
        for j in tl.static_range(TOP_K):
            _, col, experts_left = _take_largest(v, experts_left, cols)
            out = tl.where(kcols[None, :] == j, col[:, None].to(tl.int64), out)
        tl.store(out_ptr + rows[:, None] * stride_on + kcols[None, :] * stride_ok, out,
                 mask=r_ok[:, None] & (kcols < TOP_K)[None, :])  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Public op (Triton on CUDA tensors, reference otherwise)
# ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def select_experts(
    scores: torch.Tensor,
    expert_bias: torch.Tensor,
    num_groups: int,
    topk_groups: int,
    top_k: int,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """scores fp32 [N, E], expert_bias fp32 [E] -> int64 [N, top_k]: the experts of each token, largest biased
    score first (see the module docstring); the same indices from the kernel and from `select_experts_ref`."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [tokens, experts], got {scores.dtype} {tuple(scores.shape)}")
    n, e = scores.shape
    if expert_bias.shape != (e,) or expert_bias.dtype != torch.float32:
        raise ValueError(f"expert_bias must be fp32 [{e}], got {expert_bias.dtype} {tuple(expert_bias.shape)}")
    if num_groups < 1 or e % num_groups or e // num_groups < 2:
        raise ValueError(f"num_groups={num_groups} must divide the {e} experts into groups of at least 2")
    if not 1 <= topk_groups <= num_groups or not 1 <= top_k <= topk_groups * (e // num_groups):
        raise ValueError(f"need 1 <= topk_groups={topk_groups} <= num_groups={num_groups} and 1 <= top_k={top_k} "
                         f"<= topk_groups * experts per group = {topk_groups * (e // num_groups)}")  # fmt: skip
    if not use_triton(scores, backend):
        return select_experts_ref(scores, expert_bias, num_groups, topk_groups, top_k)
    out = torch.empty(n, top_k, device=scores.device, dtype=torch.int64)
    if n:
        block_e = triton.next_power_of_2(e)
        block_n = max(1, min(_VALUES_PER_PROGRAM // block_e, triton.next_power_of_2(n)))
        _select_experts_kernel[(cdiv(n, block_n),)](
            scores, expert_bias, out, n, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
            E=e, NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups, TOP_K=top_k, BLOCK_N=block_n, BLOCK_E=block_e,
            BLOCK_G=triton.next_power_of_2(num_groups), BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
        )  # fmt: skip
    return out
