"""CPU checks of `model.graphs.LayerGraphs`' decisions around a capture (the captures themselves need CUDA:
tests/model/test_graphs_gpu.py): a capture that runs out of memory leaves the run eager with a warning and the
blocks' buffers untouched; a forward that collects FP8 health releases the graphs and runs eagerly; a block run on
the capture's parameter aliases reuses the eager forward's compiled graphs and gives its bits."""

from __future__ import annotations

import logging

import torch

from fp8.linear import FP8Linear
from model.config import ModelConfig
from model.graphs import LayerGraphs, out_of_memory_advice, parameter_aliases
from model.layers import _swiglu, qk_norm_rope, rms_norm
from model.ling import LingForCausalLM
from model.moe import route
from tests.helpers import dynamo_graphs


class _OutOfMemoryCapture(LayerGraphs):
    """Takes CPU inputs and fails every capture after touching the routers' load buffers, as a warm-up does."""

    attempts = 0

    @staticmethod
    def inputs_supported(samples):
        return None

    def _capture_all(self, samples):
        type(self).attempts += 1
        for block in self.blocks:
            for b in block.buffers():
                b.add_(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 786.00 MiB")


def _models() -> tuple[LingForCausalLM, LingForCausalLM]:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=64, precision="fp8")
    eager = LingForCausalLM(cfg)
    graphed = LingForCausalLM(cfg.replace(cuda_graphs=True))
    graphed.load_state_dict(eager.state_dict())
    return eager, graphed


def _failing_capture(graphed: LingForCausalLM) -> LingForCausalLM:
    """`graphed` with every capture running out of memory."""
    graphed.graphs = _OutOfMemoryCapture([*graphed.layers, *graphed.mtp_layers], graphed.graphs.chained)
    return graphed


def test_a_capture_out_of_memory_goes_on_eagerly_with_a_warning_and_the_buffers_restored(caplog):
    eager, graphed = _models()
    _failing_capture(graphed)
    ids = torch.randint(0, 64, (2, 16))
    with caplog.at_level(logging.WARNING, logger="model.graphs"):
        losses = [graphed(ids, labels=ids).loss for _ in range(2)]
    assert _OutOfMemoryCapture.attempts == 1  # not tried again
    assert "model.cuda_graphs" in caplog.text and "ran out of GPU memory" in caplog.text
    assert "out of GPU memory" in graphed.graphs.disabled
    reference = [eager(ids, labels=ids).loss for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(losses, reference))
    for r, s in zip(eager.routers(), graphed.routers()):  # the failed capture's buffer writes undone
        assert torch.equal(r.tokens_per_expert, s.tokens_per_expert)
        assert torch.equal(r.expert_bias, s.expert_bias)


def test_the_out_of_memory_advice_names_expandable_segments_only_where_the_allocator_has_none(monkeypatch, caplog):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    graphed = _failing_capture(_models()[1])
    ids = torch.randint(0, 64, (2, 16))
    with caplog.at_level(logging.WARNING, logger="model.graphs"):
        graphed(ids, labels=ids)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in caplog.text
    assert "train.micro_batch_size" in out_of_memory_advice()
    for name, value in (("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:True"),
                        ("PYTORCH_ALLOC_CONF", "expandable_segments:True")):
        monkeypatch.setenv(name, value)
        assert "expandable_segments" not in out_of_memory_advice(), name
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert "expandable_segments:True" in out_of_memory_advice()


def test_a_forward_that_collects_fp8_health_releases_the_graphs_and_runs_eagerly():
    _, graphed = _models()
    graphs = graphed.graphs
    graphs._graphs, graphs._key = ["captured"], ("a key",)  # as after a capture
    next(m for m in graphed.modules() if isinstance(m, FP8Linear)).collect_health = True
    x = torch.zeros(2, 16, graphed.config.hidden_size)
    assert graphs.ready([(x,)] * len(graphs.blocks)) is False
    assert graphs._graphs == [] and graphs._key is None and graphs.disabled is None  # captured again next time


def _compiled_graphs() -> dict[str, int]:
    """How many dynamo graphs each compiled function of a decoder layer holds."""
    fused = {"rms_norm": rms_norm, "qk_norm_rope": qk_norm_rope, "route": route, "swiglu": _swiglu}
    return {name: dynamo_graphs(fn) for name, fn in fused.items()}


def test_a_block_on_the_capture_aliases_reuses_the_eager_compiled_graphs_and_bits():
    """`model.compile_ops=on` (Inductor's CPU backend): an MoE decoder layer called through `functional_call` on
    `parameter_aliases`, as a capture calls it, compiles no new graph for any fused function, and its output and
    the aliases' gradients are the eager forward's and backward's bits (a plain detached tensor in place of a
    Parameter makes dynamo compile again: checked last, so that this test can fail)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LingForCausalLM(ModelConfig.preset("tiny", vocab_size=64, compile_ops="on"))
    layer = model.layers[1]
    x = torch.randn(2, 24, model.config.hidden_size, requires_grad=True)  # the residual stream, as trained
    cos, sin = model.rotary.cos_sin(torch.arange(24))
    eager_out, _ = layer(x, cos, sin, None)
    eager_out.square().sum().backward()
    graphs = _compiled_graphs()
    assert all(n >= 1 for n in graphs.values()), graphs  # each function compiled

    named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    aliases = parameter_aliases(named)
    eager_grads = {n: p.grad.clone() for n, p in named}
    out, _ = torch.func.functional_call(layer, aliases, (x, cos, sin), {"mask": None})
    out.square().sum().backward()
    assert _compiled_graphs() == graphs
    assert torch.equal(out, eager_out)
    for n, p in named:
        assert aliases[n].data_ptr() == p.data_ptr() and torch.equal(p.grad, eager_grads[n]), n  # p untouched
        assert torch.equal(aliases[n].grad, eager_grads[n]), n

    # the control: a plain detached tensor in place of the Parameter compiles the function again
    norm = layer.input_layernorm
    rms_norm(x, norm.weight.detach().requires_grad_(), norm.eps, compiled=True)
    assert _compiled_graphs()["rms_norm"] == graphs["rms_norm"] + 1
    torch._dynamo.reset()
