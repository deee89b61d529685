"""The sigmoid group-limited router, the gates, and the aux-loss-free bias update."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.moe import MoE, Router


def ling_router(seed: int = 0) -> Router:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("ling_mini_2_0", hidden_size=64, num_heads=1, num_kv_heads=1, head_dim=64)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    return router


def reference_selection(scores: torch.Tensor, bias: torch.Tensor, groups: int, topk_groups: int, k: int):
    """Per token, by hand: the group score is the sum of its top-2 biased scores; then top-k inside."""
    out = []
    for s in scores + bias:
        g = s.view(groups, -1)
        group_score = g.sort(descending=True).values[:, :2].sum(-1)
        kept = group_score.argsort(descending=True)[:topk_groups]
        candidates = torch.cat([torch.arange(gi * g.shape[1], (gi + 1) * g.shape[1]) for gi in kept.tolist()])
        best = candidates[s[candidates].argsort(descending=True)[:k]]
        out.append(set(best.tolist()))
    return out


def test_selected_experts_are_top8_by_biased_score_within_top4_groups():
    router = ling_router()
    router.expert_bias.normal_(0, 0.05)
    x = torch.randn(64, 64)
    out = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    expected = reference_selection(scores, router.expert_bias, 8, 4, 8)
    assert [set(r.tolist()) for r in out.topk_idx] == expected
    groups = out.topk_idx // 32
    assert all(len(set(g.tolist())) <= 4 for g in groups)


def test_gates_are_normalised_unbiased_scores_times_scaling():
    router = ling_router(1)
    x = torch.randn(32, 64)
    out = router(x)
    torch.testing.assert_close(out.topk_weight.sum(-1), torch.full((32,), 2.5))
    scores = torch.sigmoid(x @ router.weight.T)
    chosen = scores.gather(1, out.topk_idx)
    torch.testing.assert_close(out.topk_weight, chosen / chosen.sum(-1, keepdim=True) * 2.5)


def test_bias_changes_selection_but_not_gate_values():
    router = ling_router(2)
    x = torch.randn(16, 64)
    before = router(x)
    router.expert_bias[7] = 10.0  # expert 7 now wins every token's selection
    after = router(x)
    assert (after.topk_idx == 7).any(-1).all()
    assert not torch.equal(before.topk_idx.sort(-1).values, after.topk_idx.sort(-1).values)
    scores = torch.sigmoid(x @ router.weight.T)
    chosen = scores.gather(1, after.topk_idx)  # unbiased scores: the +10 does not enter the gates
    torch.testing.assert_close(after.topk_weight, chosen / chosen.sum(-1, keepdim=True) * 2.5)


@pytest.mark.slow
def test_bias_update_moves_toward_balance_and_keeps_zero_mean():
    router = ling_router(3)
    with torch.no_grad():
        router.weight[:4] += 2.0 * router.weight[:4].sign()  # a few experts are strongly preferred...
    x = torch.randn(512, 64)
    imbalance = []
    for _ in range(200):
        router(x)
        counts = router.tokens_per_expert.clone()
        stats = router.update_expert_bias(rate=1e-3)  # the design's rate
        imbalance.append(stats["max_over_mean"])
        assert abs(float(router.expert_bias.mean())) < 1e-6  # zero-mean update
        overloaded = counts > counts.mean()
        if overloaded.any() and (~overloaded).any():
            assert router.tokens_per_expert.sum() == 0  # the counts restart each step
    # sign updates of fixed size oscillate around balance: judge the average of the last steps
    assert sum(imbalance[-20:]) / 20 < 0.5 * imbalance[0], imbalance


def test_moe_output_matches_dense_per_token_reference():
    """Sorting tokens into per-expert segments must not change the maths: compare with a token loop."""
    torch.manual_seed(5)
    cfg = ModelConfig.preset("tiny", vocab_size=64)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 7, cfg.hidden_size)
    out, routing = moe(x)
    flat = x.reshape(-1, cfg.hidden_size)
    ref = torch.zeros_like(flat, dtype=torch.float64)
    for n in range(flat.shape[0]):
        for j in range(routing.topk_idx.shape[1]):
            e = routing.topk_idx[n, j]
            gate, up = (moe.experts.gate_up_proj[e] @ flat[n]).chunk(2)
            y = moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)
            ref[n] += routing.topk_weight[n, j].double() * y.double()
    ref = ref + moe.shared_experts(flat).double()
    torch.testing.assert_close(out.reshape(-1, cfg.hidden_size).double(), ref, atol=1e-5, rtol=1e-5)
