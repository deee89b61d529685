"""CPU checks of `model.graphs.LayerGraphs`' decisions around a capture (the captures themselves need CUDA:
tests/model/test_graphs_gpu.py): a capture that runs out of memory leaves the run eager with a warning and the
blocks' buffers untouched; a forward that collects FP8 health releases the graphs and runs eagerly."""

from __future__ import annotations

import logging

import torch

from fp8.linear import FP8Linear
from model.config import ModelConfig
from model.graphs import LayerGraphs
from model.ling import LingForCausalLM


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


def test_a_capture_out_of_memory_goes_on_eagerly_with_a_warning_and_the_buffers_restored(caplog):
    eager, graphed = _models()
    graphed.graphs = _OutOfMemoryCapture([*graphed.layers, *graphed.mtp_layers], graphed.graphs.chained)
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


def test_a_forward_that_collects_fp8_health_releases_the_graphs_and_runs_eagerly():
    _, graphed = _models()
    graphs = graphed.graphs
    graphs._graphs, graphs._key = ["captured"], ("a key",)  # as after a capture
    next(m for m in graphed.modules() if isinstance(m, FP8Linear)).collect_health = True
    x = torch.zeros(2, 16, graphed.config.hidden_size)
    assert graphs.ready([(x,)] * len(graphs.blocks)) is False
    assert graphs._graphs == [] and graphs._key is None and graphs.disabled is None  # captured again next time
