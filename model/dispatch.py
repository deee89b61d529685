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

Expert parallelism (`moe.ep_size` = P > 1, `expert_parallel`): rank r of the expert-parallel group holds the
experts r·E/P … (r+1)·E/P − 1. The sender plans over all E experts *without* padding, gathers its T·k rows
(sorted by expert, so each destination's rows are contiguous) with their gates, exchanges the per-expert
counts (all_to_all on the device), then the rows and gates (all_to_all with uneven splits). The receiver sees,
from each source rank in rank order, that rank's rows for each of its experts; `plan_dispatch` over those rows
(k = 1, local expert ids) sorts them stably into one segment per local expert — source 0's tokens, then source
1's, … — and pads each segment at its end (routing-map padding happens here, on the receiving side, so that a
segment is laid out exactly as one process holding the whole global batch would lay it out: the same rows in
the same order, the same 16-aligned offsets, hence the same bits). The experts run on those rows, their
outputs go back by the reverse exchange, and the sender combines them as without expert parallelism. Both
exchanges are autograd functions whose backward is the reverse exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fp8.grouped import GroupedRows
from kernels.fusable import Fusable
from kernels.rows import gather_rows, sum_rows


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


def plan_dispatch(topk_idx: torch.Tensor, num_experts: int, pad_multiple: int = 1,
                  compiled: bool = False) -> DispatchPlan:
    """topk_idx int64 [T, k] (distinct experts per token) → DispatchPlan, on topk_idx's device, sync-free.
    `compiled`: the plan's tensor maths (`plan_rows`) through torch.compile — for static shapes only (one
    graph per T), not for the expert-parallel receiver, whose row count changes every call."""
    if pad_multiple < 1:
        raise ValueError(f"moe.pad_multiple must be >= 1, got {pad_multiple}")
    t, k = topk_idx.shape
    rows_bound = (t * k + num_experts * (pad_multiple - 1) + 15) // 16 * 16
    row_src, pos, offsets, counts, pad_token, num_pad = plan_rows(topk_idx, num_experts, pad_multiple, rows_bound,
                                                                  compiled=compiled)  # fmt: skip
    rows = GroupedRows(offsets, rows_bound, alignment=pad_multiple, data_lengths=counts)
    return DispatchPlan(row_src=row_src, pos=pos, rows=rows, tokens_per_expert=counts, pad_token=pad_token,
                        num_pad=num_pad)


@Fusable
def plan_rows(topk_idx: torch.Tensor, e: int, a: int, rows_bound: int) -> tuple[torch.Tensor, ...]:
    """The tensors of `plan_dispatch(topk_idx [T, k], e experts, pad multiple a)` with `rows_bound` rows:
    (row_src int32 [rows_bound], pos int32 [T, k], offsets int32 [e + 1], counts int64 [e],
    pad_token int64 [e, a - 1], num_pad int64 [e])."""
    t, k = topk_idx.shape
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
    pos = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, order, dest)
    sorted_token = order // k
    row_src = torch.full((rows_bound,), -1, dtype=torch.int32, device=dev)
    row_src.scatter_(0, dest, sorted_token.to(torch.int32))
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    pad_token = _pad_tokens(sorted_token, sorted_expert, rank, e, a, t)
    return row_src, pos.view(t, k).to(torch.int32), offsets, counts, pad_token, padded - counts


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
    return token % max(t, 1)  # t = 0: an expert-parallel rank that received no rows (no pad slot is used)


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


# ----------------------------------------------------------------------------------------------------------
# Expert parallelism
# ----------------------------------------------------------------------------------------------------------
def _exchange(x: torch.Tensor, send: list[int], recv: list[int], out_rows: int, group) -> torch.Tensor:
    """all_to_all of rows: x[:sum(send)] goes out in `send` splits (one per rank of `group`, in rank order), the
    `recv` splits arrive in rank order into out[:sum(recv)] of a new [out_rows, ...] tensor (the rest zero)."""
    n_in, n_out = sum(send), sum(recv)
    out = x.new_empty(out_rows, *x.shape[1:])
    out[n_out:].zero_()
    dist.all_to_all_single(out[:n_out], x[:n_in].contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=group)  # fmt: skip
    return out


class _AllToAll(torch.autograd.Function):
    """`_exchange` with the reverse exchange as its backward (gradient rows travel back to where the rows came
    from; rows of x past sum(send) get zero gradient)."""

    @staticmethod
    def forward(ctx, x, send, recv, out_rows, group):
        ctx.send, ctx.recv, ctx.in_rows, ctx.group = send, recv, x.shape[0], group
        return _exchange(x, send, recv, out_rows, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.in_rows, ctx.group), None, None, None, None


Experts = Callable[[torch.Tensor, torch.Tensor, DispatchPlan], torch.Tensor]


def expert_parallel(experts: Experts, x: torch.Tensor, topk_weight: torch.Tensor, plan: DispatchPlan,
                    pad_multiple: int, group) -> torch.Tensor:  # fmt: skip
    """The routed experts' output Σ_j topk_weight[t, j]·expert_{e(t,j)}(x[t]) [T, H], the experts split over the
    P ranks of `group` (see the module doc).

    x [T, H] this rank's tokens; topk_weight [T, k]; plan: `plan_dispatch` of this rank's choices over all E
    experts without padding; experts(rows [N, H], gates [N, 1], local plan) → [N, H] runs this rank's E/P
    experts (`GroupedExperts`) on the N rows it received, padded to `pad_multiple` per expert.

    One host sync: `all_to_all_single` with uneven splits takes the split sizes as host lists, so after the
    on-device exchange of the per-expert counts the host reads them once (the return exchange and both
    backward exchanges reuse them)."""
    ep = dist.get_world_size(group)
    local = plan.tokens_per_expert.numel() // ep
    counts = plan.tokens_per_expert.view(ep, local)  # [destination rank, its local expert]
    recv_counts = torch.empty_like(counts)  # [source rank, my local expert]
    dist.all_to_all_single(recv_counts, counts, group=group)
    splits = torch.cat([counts.sum(1), recv_counts.sum(1)]).tolist()  # the host sync
    send, recv = splits[:ep], splits[ep:]
    n_recv = sum(recv)
    rows = _AllToAll.apply(permute(x, plan), send, recv, n_recv, group)
    gates = _AllToAll.apply(row_gates(topk_weight, plan)[:, None], send, recv, n_recv, group)
    expert_ids = torch.arange(local, device=x.device).repeat(ep)
    expert_of_row = expert_ids.repeat_interleave(recv_counts.flatten(), output_size=n_recv)
    local_plan = plan_dispatch(expert_of_row[:, None], local, pad_multiple)
    y = experts(rows, gates, local_plan)
    return unpermute(_AllToAll.apply(y, recv, send, plan.rows.num_rows, group), plan)
