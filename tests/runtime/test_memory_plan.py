"""The memory plan (ling/train/memory_plan.py): hand-computed parts for a tiny config, the estimate against the
peaks measured on one H200 for the e64 proxy, the refusal of the flagship on one GPU naming what fits, and the
activation model against the tensors autograd really keeps (FP8 experts on CPU; whole layers on a GPU)."""

from __future__ import annotations

import pytest
import torch

from ling.config import model_config_from
from ling.train.engine import cap_zero_buckets
from ling.train.memory_plan import (
    GIB,
    MemorySetup,
    ParameterSplit,
    activation_bytes_per_token,
    plan_for,
    plan_memory,
)
from model.config import ModelConfig
from tests.helpers import compose_cfg

TINY_PARAMETERS = (8192 * 128  # embedding
                   + (49216 + 256 + 147456)  # dense layer: attention (qkv 256x128, dense 128x128, qk norms), norms, MLP
                   + 2 * (49216 + 256 + 2048 + 786432 + 49152)  # 2 MoE layers: + router, 16 experts, shared expert
                   + 128 + 8192 * 128  # final norm, LM head
                   + (3 * 128 + 2 * 128 * 128 + 49216 + 256 + 2048 + 786432 + 49152))  # MTP: norms, eh_proj, MoE layer


def test_the_tiny_plan_part_by_part_as_computed_by_hand():
    """ZeRO-1, bf16 with fp32 accumulation (DeepSpeed's BF16_Optimizer), AdamW, 2 ranks, 2 x 64 tokens."""
    model = ModelConfig.preset("tiny")
    split = ParameterSplit.of(model)
    assert split.total == TINY_PARAMETERS == 4_988_672
    assert split.experts == 3 * 16 * (256 * 128 + 128 * 128)
    plan = plan_for(MemorySetup(model, world=2, zero_stage=1, optimizer="adamw", micro_batch_size=2, seq_len=64))
    p = TINY_PARAMETERS
    # activations per token, bf16 (2 bytes); a norm keeps its input and an fp32 rstd: 128·2 + 4 = 260
    attention = 260 + 256 + 512 + 4 * 6 + 384 + 256 + 16 + 256  # norm, qkv in, qkv out, rstd, q+k, out, lse, dense in
    dense_mlp = 260 + 256 + 2 * 384 * 2 + 384 * 2  # norm, gate_up in, gate_up out, down in
    moe = 260 + 256 + 8 * 16 + 4 * (2 * (128 + 5 * 128) + 4) + (2 * 128 * 2 + 128 * 2)  # norm, h, router, rows, shared
    mtp_extra = 2 * 260 + 2 * 128 * 2 + 260  # enorm, hnorm, eh_proj's input [2H], final norm
    head = 8 * 2 + 260 + 2 * 128 * 2  # token ids (main + MTP), final norm, dh of both loss calls
    per_token = (attention + dense_mlp) + 3 * (attention + moe) + mtp_extra + head
    assert per_token == 35472
    assert plan.parts == {
        "weights": 2 * p, "gradients": 4 * p,  # bf16 weights; whole fp32 gradients on each GPU
        "master weights": 4 * p / 2, "optimizer moments": 8 * p / 2,  # 1/world each
        "FP8 weight caches": 0, "activations": per_token * 128,
        # fp32 dW per loss call; one chunk of bf16 logits and their bf16 gradient (the Triton epilogue on a GPU)
        "LM-head transients": 2 * 4 * 8192 * 128 + (2 + 2) * 128 * 8192,
    }
    # off the GPU: fp32 weights and activations, and the eager epilogue's fp32 copy of the chunk's logits
    cpu = plan_for(MemorySetup(model, world=2, zero_stage=1, optimizer="adamw", micro_batch_size=2, seq_len=64,
                               bf16=False, on_gpu=False))
    assert cpu.parts["LM-head transients"] == 2 * 4 * 8192 * 128 + (4 + 4 + 4) * 128 * 8192


@pytest.mark.parametrize("ep_size", [1, 2])
def test_the_zero2_buckets_are_the_parameters_this_rank_holds(ep_size):
    """ZeRO-2's reduce and allgather buckets, capped by ling.train.engine.cap_zero_buckets at the parameters a
    rank holds (its 1/ep_size of the experts under expert parallelism): the plan's gradient part counts the same."""
    model = ModelConfig.preset("tiny").replace(ep_size=ep_size)
    split = ParameterSplit.of(model)
    local = split.total - split.experts + split.experts // ep_size
    zero = {"stage": 2}
    cap_zero_buckets({"zero_optimization": zero}, local)  # the buckets the engine gives this rank's DeepSpeed
    buckets = zero["reduce_bucket_size"] + zero["allgather_bucket_size"]
    parts = plan_for(MemorySetup(model, world=2, zero_stage=2, micro_batch_size=2, seq_len=64), split).parts
    # the fp32 partition and the two bf16 buckets; the cap rounds each bucket up to even (at most 2 bytes apart)
    assert parts["gradients"] == pytest.approx(4 * split.total / 2 + 2 * buckets, abs=4)


# One H200, e64 proxy (ling_mini_2_0_e64), ZeRO-1 with fp32 accumulation, seq 4096, grad_accum 8, no recompute:
# peak torch.cuda.max_memory_allocated in GiB (docs/runtime_scale.md), and rank 0's optimizer state.
MEASURED_PEAKS = {("bf16", 1): 96.8, ("bf16", 4): 127.4, ("bf16", 5): 137.1, ("fp8", 1): 69.1, ("fp8", 4): 87.0,
                  ("fp8", 12): 130.7, ("fp8_bf16wgrad", 12): 118.9}
MEASURED_OPTIMIZER_STATE = {"bf16": 55.84, "fp8": 28.21}


def e64_setup(variant: str, micro_batch: int) -> MemorySetup:
    precision = "bf16" if variant == "bf16" else "fp8"
    model = ModelConfig.preset("ling_mini_2_0_e64", precision=precision,
                               fp8_expert_wgrad="bf16" if variant == "fp8_bf16wgrad" else "fp8")
    return MemorySetup(model, world=1, zero_stage=1, optimizer="adamw" if precision == "bf16" else "fp8_adamw",
                       micro_batch_size=micro_batch, seq_len=4096)


@pytest.mark.parametrize(("variant", "micro_batch"), list(MEASURED_PEAKS))
def test_the_estimate_is_within_15_percent_of_the_peak_measured_on_the_h200(variant, micro_batch):
    plan = plan_for(e64_setup(variant, micro_batch))
    measured = MEASURED_PEAKS[(variant, micro_batch)]
    assert plan.total / GIB == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_the_optimizer_state_matches_what_rank_0_measured(variant):
    parts = plan_for(e64_setup(variant, 1)).parts
    state = (parts["master weights"] + parts["optimizer moments"]) / GIB
    assert state == pytest.approx(MEASURED_OPTIMIZER_STATE[variant], rel=0.01)


def test_the_flagship_on_one_gpu_is_refused_naming_what_would_fit():
    """`torchrun --nproc_per_node 1 train.py +exp=fp8_mtp` died with `Tried to allocate 61.37 GiB` (the fp32
    gradients of the BF16_Optimizer); the plan says so before building anything, and what would fit."""
    cfg = compose_cfg(["+exp=fp8_mtp"])
    plan = plan_memory(cfg, model_config_from(cfg, 8192), world=1)
    assert f"{plan.parts['gradients'] / GIB:.2f}" == "61.37"
    h200 = 150_754_820_096  # torch.cuda.get_device_properties(0).total_memory on an H200
    message = plan.refusal(h200, visible_gpus=1)
    assert message.startswith(f"the run needs ≈ {plan.total / GIB:.1f} GiB per GPU (weights 30.7, gradients 61.4")
    assert "but a GPU has 140.4 GiB (1 visible)" in message
    assert "with 4 GPUs (ZeRO-1) it is ≈" in message and "moe.ep_size=2" in message
    assert "train.memory_check=false" in message
    eight = plan_memory(cfg, model_config_from(cfg, 8192), world=8)
    assert eight.refusal(h200) is None and eight.total < h200


def test_recomputation_and_expert_parallelism_shrink_the_plan_where_they_should():
    base = e64_setup("fp8", 4)
    split = ParameterSplit.of(base.model)
    none = plan_for(base, split).parts
    full = plan_for(base.replace(model=base.model.replace(recompute="full")), split).parts
    selective = plan_for(base.replace(model=base.model.replace(recompute="selective")), split).parts
    assert full["activations"] < selective["activations"] < none["activations"]
    assert {k: v for k, v in full.items() if k != "activations"} == {
        k: v for k, v in none.items() if k != "activations"}
    ep = plan_for(base.replace(world=8, model=base.model.replace(ep_size=8)), split).parts
    dp = plan_for(base.replace(world=8), split).parts
    assert ep["weights"] < dp["weights"] and ep["master weights"] == dp["master weights"]


# ------------------------------------------------------------------------------------- the activation model
def saved_bytes(run, exclude: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while `run()` executes, without those of
    `exclude` (parameters, weight caches)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(seen.values())


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_the_fp8_experts_keep_what_the_model_says(triton_interpreter, wgrad):
    """The FP8 grouped experts' saved tensors (Triton interpreter on CPU), per token, against the formula's
    routed-experts term: E4M3 gate/up outputs with scales, gates, row indices, and xᵀ in FP8 (fp8 wgrad) or
    nothing beyond x itself (bf16 wgrad)."""
    from model.dispatch import plan_dispatch
    from model.moe import GroupedExperts

    model = ModelConfig(vocab_size=256, hidden_size=128, num_layers=1, num_dense_layers=0, num_heads=1,
                        num_kv_heads=1, head_dim=128, num_experts=4, num_experts_per_tok=2, num_expert_groups=2,
                        topk_groups=2, expert_intermediate_size=128, num_mtp_layers=0, precision="fp8",
                        fp8_expert_wgrad=wgrad)
    tokens, k, a = 256, 2, 2
    experts = GroupedExperts(model).to(torch.bfloat16)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.02)
    torch.nn.init.normal_(experts.down_proj, std=0.02)
    x = torch.randn(tokens, 128, dtype=torch.bfloat16, requires_grad=True)
    topk = torch.stack([torch.randperm(4)[:k] for _ in range(tokens)])
    gates = torch.rand(tokens, k)
    plan = plan_dispatch(topk, 4, pad_multiple=16)
    caches = [*experts._gate_up_fp8.get(experts.gate_up_proj), *experts._down_fp8.get(experts.down_proj)]
    measured = saved_bytes(lambda: experts(x, gates, plan), [experts.gate_up_proj, experts.down_proj, *caches])
    expected = activation_bytes_per_token(model, a, tokens)["routed_experts"]
    assert measured / tokens == pytest.approx(expected, rel=0.05)


def layer_activation_bytes(layer, x: torch.Tensor, *args) -> int:
    """GPU: bytes one forward of `layer` with grad keeps for backward: what freeing its output and autograd graph
    gives back, output excluded. (Not the allocation's growth over the forward: a library's first call on a new
    shape or stream may also keep a workspace for the process, which is not an activation.)"""
    torch.cuda.synchronize()
    out = layer(x, *args)
    out = out[0] if isinstance(out, tuple) else out
    torch.cuda.synchronize()
    with_graph = torch.cuda.memory_allocated()
    out_bytes = out.numel() * out.element_size()
    del out  # frees the output and every tensor saved for backward
    torch.cuda.synchronize()
    return with_graph - torch.cuda.memory_allocated() - out_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_one_e64_layer_keeps_what_the_model_says_on_the_gpu(precision):
    """A dense and a MoE decoder layer of the e64 proxy at 4096 tokens, as trained (bf16, compiled ops, flex
    attention over documents): the memory one forward keeps against the formula, within 10 %."""
    from model.layers import RotaryEmbedding, attention_mask
    from model.ling import DecoderLayer

    # The compiled ops as a training process has them: this pytest worker's earlier GPU tests may have compiled
    # the shared Fusable functions (kernels/fusable.py) at eight other shapes, dynamo's recompile limit, after
    # which they run eagerly (an eager SwiGLU keeps silu(gate) too: 10,240 B/token more, seen on an H200).
    torch._dynamo.reset()
    model = ModelConfig.preset("ling_mini_2_0_e64", precision=precision)
    tokens = 4096
    per_token = activation_bytes_per_token(model, 2, tokens)
    rotary = RotaryEmbedding(model.rotary_dim, model.rope_base).cuda()
    cos, sin = rotary.cos_sin(torch.arange(tokens, device="cuda"))
    doc_ids = torch.repeat_interleave(torch.arange(4, device="cuda"), tokens // 4)[None]
    mask = attention_mask(doc_ids, model)
    existing = model.hidden_size * 2  # the layer's input x: kept for backward, but allocated before the forward
    for moe, expected in ((False, per_token["attention"] + per_token["dense_mlp"] - existing),
                          (True, per_token["attention"] + per_token["moe"] - existing)):
        layer = DecoderLayer(model, moe=moe).cuda().to(torch.bfloat16)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
        x = torch.randn(1, tokens, model.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        layer_activation_bytes(layer, x, cos, sin, mask)  # compile and fill the FP8 weight caches first
        kept = layer_activation_bytes(layer, x, cos, sin, mask)
        assert kept / tokens == pytest.approx(expected, rel=0.10), (moe, kept / tokens, expected)
