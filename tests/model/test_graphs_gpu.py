"""GPU checks of `model.cuda_graphs` (model/graphs.py): a graphed model gives the eager model's losses, gradients
and expert loads over gradient accumulation, after a weight update (the FP8 weight caches refreshed in place) and
when a step collects FP8 health (the graphs released, the step eager, captured again after); it recaptures when a
layer falls back to high precision; the FP8 wgrads write their gradients into the shared slab instead of being
copied there."""

from __future__ import annotations

import pytest
import torch

from fp8.linear import FP8Linear, invalidate_fp8_weight_caches
from model.config import ModelConfig
from model.ling import LingForCausalLM
from model.moe import GroupedExperts
from tests.helpers import rel

pytestmark = pytest.mark.gpu


def _models(precision: str, recompute: str) -> tuple[LingForCausalLM, LingForCausalLM]:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=1024, hidden_size=256, expert_intermediate_size=128, num_experts=16,
                             num_heads=2, num_kv_heads=1, head_dim=128, precision=precision, recompute=recompute)
    eager = LingForCausalLM(cfg).cuda().bfloat16().train()
    graphed = LingForCausalLM(cfg.replace(cuda_graphs=True)).cuda().bfloat16().train()
    graphed.load_state_dict(eager.state_dict())
    return eager, graphed


def _micro_batches(model: LingForCausalLM, batches) -> list[torch.Tensor]:
    """Forward + backward of each micro-batch, gradients accumulating in .grad (no hook consumes them)."""
    losses = []
    for ids, labels in batches:
        out = model(ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.detach())
    return losses


def _update(model: LingForCausalLM) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.data.add_(p.grad, alpha=-1e-2)  # through .data, as DeepSpeed writes: the caches must be told
            p.grad = None
    invalidate_fp8_weight_caches(model)


def _check_same(eager, graphed, e_losses, g_losses) -> None:
    # the replay runs the eager kernels on the same inputs: the losses agree to the last bit where every kernel is
    # deterministic; allow 1e-6 relative for atomics in the backward kernels feeding later micro-batches
    for a, b in zip(e_losses, g_losses):
        assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=0), (a, b)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert rel(q.grad.float(), p.grad.float()) < 1e-3, name
    for r, s in zip(eager.routers(), graphed.routers()):
        assert torch.equal(r.tokens_per_expert, s.tokens_per_expert)


@pytest.mark.parametrize("precision,recompute", [("fp8", "none"), ("bf16", "none"), ("fp8", "selective")])
def test_graphed_model_matches_eager_over_accumulation_and_a_weight_update(precision, recompute):
    eager, graphed = _models(precision, recompute)
    batches = [(torch.randint(0, 1024, (2, 256), device="cuda"),) * 2 for _ in range(3)]
    batches = [(ids, torch.roll(ids, -1, 1)) for ids, _ in batches]
    _check_same(eager, graphed, _micro_batches(eager, batches), _micro_batches(graphed, batches))
    assert graphed.graphs._graphs, "the graphed model ran eagerly"
    _update(eager)
    _update(graphed)
    for r in (*eager.routers(), *graphed.routers()):
        r.tokens_per_expert.zero_()
    _check_same(eager, graphed, _micro_batches(eager, batches[:2]), _micro_batches(graphed, batches[:2]))


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_only_gradients_without_an_fp8_wgrad_are_copied_into_the_slab(precision):
    """FP8: the experts' and FP8Linears' weight gradients are written into the slab by their wgrad GEMMs
    (kernels.gradient_outputs); the norms', the router's and the rest are copied. BF16: everything is copied."""
    _, graphed = _models(precision, "none")
    ids = torch.randint(0, 1024, (2, 256), device="cuda")
    _micro_batches(graphed, [(ids, torch.roll(ids, -1, 1))])
    assert graphed.graphs._graphs, "the graphed model ran eagerly"
    for graph in graphed.graphs._graphs:
        direct = set()
        if precision == "fp8":
            for m in graph.block.modules():
                if isinstance(m, FP8Linear):
                    direct.add(id(m.weight))
                if isinstance(m, GroupedExperts):
                    direct |= {id(m.gate_up_proj), id(m.down_proj)}
        assert graph.copied == sum(p.numel() for p in graph.params if id(p) not in direct)
        assert graph.copied < sum(p.numel() for p in graph.params) or precision == "bf16"


def _next_step(*models: LingForCausalLM, health: bool) -> None:
    """What a new optimizer step looks like to the graphs: no gradients, no loads counted, the monitor's choice."""
    for model in models:
        for m in model.modules():
            if isinstance(m, FP8Linear):
                m.collect_health = health
        for p in model.parameters():
            p.grad = None
        for r in model.routers():
            r.tokens_per_expert.zero_()


def test_health_steps_run_eagerly_and_a_fallback_recaptures():
    eager, graphed = _models("fp8", "none")
    ids = torch.randint(0, 1024, (2, 256), device="cuda")
    batch = [(ids, torch.roll(ids, -1, 1))]
    _micro_batches(graphed, batch)
    captured = graphed.graphs._graphs
    _next_step(eager, graphed, health=True)
    _check_same(eager, graphed, _micro_batches(eager, batch), _micro_batches(graphed, batch))
    assert graphed.graphs._graphs == []  # released: the eager step has an eager run's memory
    assert any(m.health for m in graphed.modules() if isinstance(m, FP8Linear))  # the eager pass collected
    _next_step(eager, graphed, health=False)
    _check_same(eager, graphed, _micro_batches(eager, batch), _micro_batches(graphed, batch))
    assert graphed.graphs._graphs and graphed.graphs._graphs is not captured  # captured again
    captured = graphed.graphs._graphs
    _next_step(eager, graphed, health=False)
    for model in (eager, graphed):
        model.layers[1].attention.dense.use_fp8 = False  # the monitor's per-layer fallback
    _check_same(eager, graphed, _micro_batches(eager, batch), _micro_batches(graphed, batch))
    assert graphed.graphs._graphs is not captured  # captured again


def test_graphs_are_refused_where_they_cannot_run():
    cfg = ModelConfig.preset("tiny", vocab_size=64)
    with pytest.raises(ValueError, match="model.cuda_graphs"):
        cfg.replace(cuda_graphs=True, recompute="full")
    model = LingForCausalLM(cfg.replace(cuda_graphs=True, document_attention="flex")).cuda().train()
    ids = torch.randint(0, 64, (2, 128), device="cuda")
    doc_ids = torch.arange(128, device="cuda").div(64, rounding_mode="floor").expand(2, -1)
    with pytest.raises(ValueError, match="BlockMask"):
        model(ids, labels=ids, doc_ids=doc_ids)


def test_a_backward_through_an_overwritten_graphed_forward_is_refused():
    _, graphed = _models("bf16", "none")
    ids = torch.randint(0, 1024, (2, 256), device="cuda")
    first = graphed(ids, labels=ids).loss
    second = graphed(ids, labels=ids).loss  # replays the graphs: the first forward's activations are gone
    second.backward()
    with pytest.raises(RuntimeError, match="overwrote its activations"):
        first.backward()
