"""Dispatch and combine: the routing map → expert-sorted rows (with routing-map padding) and back.

`plan_dispatch(topk_idx, num_experts, pad_multiple)` turns the router's choices into a `DispatchPlan`, built
entirely on the device with static shapes (no `.item()`, no `.tolist()`, no host-side bincount), so the host
never waits for the GPU here:
- `row_src` int32 [M]: the token each expert-sorted row reads; segment e (rows offsets[e] : offsets[e+1]) holds
  expert e's tokens in token order.
- `pos` int32 [T, k]: the row that holds assignment (token t, slot j); the combine is out[t] = Σ_j y[pos[t, j]].
- routing-map padding (`pad_multiple` > 1, `moe.pad_for_fp8`): every expert's segment is rounded up to a
  multiple of `pad_multiple` by routing to it extra tokens with gate 0 — the first tokens not already routed
  to that expert (Megatron's `moe_router_padding_for_fp8`), placed at the segment's end (`pad_token`). Their
  rows read zeros (row_src = -1): a pad row then adds exactly nothing anywhere (the gate is 0, and a zero row
  leaves the last token block's FP8 scale of wgrad's operands unchanged), so the MoE output and every
  gradient are bit-identical with and without padding, while every segment offset is 16-aligned for the
  grouped kernels. Expert-bias load counts and the z-loss come from the router, i.e. the unpadded map.
- M = T·k + E·(pad_multiple − 1) rounded up to 16 is a static bound on the padded row count; rows past
  offsets[E] are unused.

`permute` / `unpermute` are the bf16 path's gather and ordered gather-sum with their adjoints (no atomics,
deterministic); the FP8 experts fuse both into their own kernels (`fp8.grouped.fp8_grouped_experts`).
Expert parallelism (`moe.ep_size` > 1) adds an all-to-all exchange between plan and experts; see the
expert-parallel issue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8.grouped import GroupedRows, gather_rows, sum_rows


@dataclass
class DispatchPlan:
    """Where each (token, slot) assignment sits in the expert-sorted row layout. Shapes: T tokens, k slots,
    E experts, M rows (static bound), A = pad_multiple."""

    row_src: torch.Tensor  # int32 [M]: token read by each row; -1 for pad rows and unused rows
    pos: torch.Tensor  # int32 [T, k]: row of assignment (t, j)
    rows: GroupedRows  # offsets int32 [E + 1] of the (padded) segments
    tokens_per_expert: torch.Tensor  # int64 [E]: real (unpadded) assignments per expert
    pad_token: torch.Tensor  # int64 [E, A - 1]: token of pad slot i of expert e (valid for i < num_pad[e])
    num_pad: torch.Tensor  # int64 [E]: pad rows of each expert

    @property
    def num_tokens(self) -> int:
        return self.pos.shape[0]

    def padded_routing_map(self) -> torch.Tensor:
        """bool [T, E]: the routing map after padding (real assignments plus pad assignments)."""
        t, k = self.pos.shape
        e = self.tokens_per_expert.numel()
        routed = torch.zeros(t, e, dtype=torch.bool, device=self.pos.device)
        expert_of_row = torch.searchsorted(self.rows.offsets[1:].long(), torch.arange(
            self.rows.num_rows, device=self.pos.device), right=True)  # fmt: skip
        rows = self.pos.reshape(-1).long()
        routed[torch.arange(t, device=rows.device).repeat_interleave(k), expert_of_row[rows]] = True
        slots = torch.arange(self.pad_token.shape[1], device=rows.device)
        valid = slots[None, :] < self.num_pad[:, None]
        experts = torch.arange(e, device=rows.device)[:, None].expand_as(self.pad_token)
        routed[self.pad_token[valid], experts[valid]] = True
        return routed


def plan_dispatch(topk_idx: torch.Tensor, num_experts: int, pad_multiple: int = 1) -> DispatchPlan:
    """topk_idx int64 [T, k] (distinct experts per token) → DispatchPlan, on topk_idx's device, sync-free."""
    if pad_multiple < 1:
        raise ValueError(f"moe.pad_multiple must be >= 1, got {pad_multiple}")
    t, k = topk_idx.shape
    e, a = num_experts, pad_multiple
    dev = topk_idx.device
    flat = topk_idx.reshape(-1)
    n = flat.numel()
    counts = torch.zeros(e, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (a - 1)) // a * a
    real_start = torch.cumsum(counts, 0) - counts
    seg_start = torch.cumsum(padded, 0) - padded
    # stable sort by expert: within an expert, assignments stay in token order
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(n, device=dev) - real_start[sorted_expert]  # index within the expert's tokens
    dest = seg_start[sorted_expert] + rank
    rows_bound = n + e * (a - 1)
    rows_bound = (rows_bound + 15) // 16 * 16
    pos = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, order, dest)
    sorted_token = order // k
    row_src = torch.full((rows_bound,), -1, dtype=torch.int32, device=dev)
    row_src.scatter_(0, dest, sorted_token.to(torch.int32))
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    pad_token = _pad_tokens(sorted_token, sorted_expert, rank, e, a, t)
    rows = GroupedRows(offsets, rows_bound, alignment=a, data_lengths=counts)
    return DispatchPlan(row_src=row_src, pos=pos.view(t, k).to(torch.int32), rows=rows, tokens_per_expert=counts,
                        pad_token=pad_token, num_pad=padded - counts)  # fmt: skip


def _pad_tokens(sorted_token, sorted_expert, rank, e: int, a: int, t: int) -> torch.Tensor:
    """The first A − 1 tokens not routed to each expert, without a host sync: for an expert's routed tokens
    s_0 < s_1 < …, c_i = s_i − i counts the unrouted tokens before s_i, so the j-th unrouted token is
    j + #{i : c_i <= j}; one [E, A] histogram of min(c_i, A − 1) gives every count. Where an expert has
    fewer than A − 1 unrouted tokens (tiny batches), the last slots wrap to other tokens."""
    if a == 1:
        return torch.zeros(e, 0, dtype=torch.int64, device=sorted_token.device)
    gaps = (sorted_token - rank).clamp(max=a - 1)
    hist = torch.zeros(e * a, dtype=torch.int64, device=sorted_token.device)
    hist.scatter_add_(0, sorted_expert * a + gaps, torch.ones_like(gaps))
    before = torch.cumsum(hist.view(e, a), 1)[:, : a - 1]  # routed tokens before the j-th unrouted one
    token = torch.arange(a - 1, device=sorted_token.device)[None, :] + before
    return token % t


class _Permute(torch.autograd.Function):
    """x [T, H] → rows [M, H] = x[row_src] (zero rows for -1); backward: dx[t] = Σ_j drows[pos[t, j]]."""

    @staticmethod
    def forward(ctx, x, row_src, pos):
        ctx.save_for_backward(pos)
        return gather_rows(x, row_src)

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return sum_rows(grad, pos), None, None


class _Unpermute(torch.autograd.Function):
    """rows [M, H] → out [T, H] = Σ_j rows[pos[t, j]] (fp32 sums); backward: drows = dout[row_src]."""

    @staticmethod
    def forward(ctx, y, row_src, pos):
        ctx.save_for_backward(row_src)
        return sum_rows(y, pos)

    @staticmethod
    def backward(ctx, grad):
        (row_src,) = ctx.saved_tensors
        return gather_rows(grad.contiguous(), row_src), None, None


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Tokens [T, H] → expert-sorted rows [M, H] (pad and unused rows zero)."""
    return _Permute.apply(x, plan.row_src, plan.pos)


def unpermute(y: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Expert-sorted rows [M, H] → tokens [T, H]: the sum of each token's k rows, in fp32, in y's dtype."""
    return _Unpermute.apply(y, plan.row_src, plan.pos)


def row_gates(topk_weight: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Gates [T, k] → per-row gates [M] (0 for pad and unused rows), differentiable (its adjoint is a gather)."""
    flat = topk_weight.reshape(-1)
    return flat.new_zeros(plan.rows.num_rows).index_copy(0, plan.pos.reshape(-1).long(), flat)
