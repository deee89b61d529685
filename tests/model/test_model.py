"""The Ling model: causality, MTP labels and loss, param counts, overfitting, exactness details."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fp8.grouped import quantize_expert_weights
from fp8.linear import FP8Linear, invalidate_fp8_weight_caches
from fp8.quant import quantize_128x128
from model.config import ModelConfig
from model.layers import RMSNorm, RotaryEmbedding, apply_rotary, document_block_mask
from model.ling import IGNORE_INDEX, LingForCausalLM, count_parameters, shift_left
from model.moe import GroupedExperts


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.preset("tiny", vocab_size=257, **overrides)


def test_causality_changing_token_t_changes_no_earlier_logit():
    torch.manual_seed(0)
    model = LingForCausalLM(tiny()).eval()
    ids = torch.randint(0, 257, (2, 24))
    t = 13
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % 257
    with torch.no_grad():
        a, b = model(ids), model(changed)
    # Not bit-exact: the changed token may be routed to other experts, which changes the segment sizes
    # of the per-expert matmuls, and BLAS may then sum a row's products in another order (~1e-7 relative).
    # A causal leak would move logits by ~1e-2 (the change at t moves them by > 0.1).
    torch.testing.assert_close(a.logits[:, :t], b.logits[:, :t], atol=1e-5, rtol=1e-5)
    assert (a.logits[:, t] - b.logits[:, t]).abs().max() > 1e-2
    # MTP depth 1 at position p reads token p+1, so positions < t-1 are untouched
    torch.testing.assert_close(a.mtp_logits[0][:, : t - 1], b.mtp_logits[0][:, : t - 1], atol=1e-5, rtol=1e-5)


def test_invalidating_the_fp8_weight_caches_requantizes_every_fp8_weight_of_the_model():
    """DeepSpeed writes updated weights through `.data` (no autograd version bump): the caches keep the stale FP8
    weights until `invalidate_fp8_weight_caches(model)`, which reaches the FP8Linears and the grouped experts."""
    torch.manual_seed(0)
    model = LingForCausalLM(tiny(precision="fp8"))
    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert linears and experts

    def cached():
        return ([lin.quantized_weight()[0] for lin in linears]
                + [e._gate_up_fp8.get(e.gate_up_proj)[0] for e in experts]
                + [e._down_fp8.get(e.down_proj)[0] for e in experts])

    before = cached()
    assert all(a is b for a, b in zip(before, cached()))  # reused while the weights are unchanged
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(torch.randn_like(p))  # behind autograd's back
    assert all(a is b for a, b in zip(before, cached()))  # stale until invalidated
    invalidate_fp8_weight_caches(model)
    fresh = ([quantize_128x128(lin.weight.detach())[0] for lin in linears]
             + [quantize_expert_weights(e.gate_up_proj.detach())[0] for e in experts]
             + [quantize_expert_weights(e.down_proj.detach())[0] for e in experts])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cached(), fresh))


def test_mtp_labels_are_main_labels_shifted_one_more_and_row_end_masked():
    labels = torch.arange(20).view(2, 10)
    shifted = shift_left(labels, 1, IGNORE_INDEX)
    assert torch.equal(shifted[:, :-1], labels[:, 1:])
    assert (shifted[:, -1] == IGNORE_INDEX).all()  # no leakage of the next row's first target


def test_mtp_loss_uses_shifted_labels():
    torch.manual_seed(1)
    model = LingForCausalLM(tiny()).eval()
    ids = torch.randint(0, 257, (2, 16))
    labels = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        out = model(ids, labels=labels)  # fused chunked loss, no logits
        with_logits = model(ids, labels=labels, return_logits=True)
    assert out.logits is None and out.mtp_logits is None
    expected_mtp = F.cross_entropy(with_logits.mtp_logits[0][:, :-1].reshape(-1, 257).float(),
                                   labels[:, 1:].reshape(-1))
    expected_lm = F.cross_entropy(with_logits.logits.reshape(-1, 257).float(), labels.reshape(-1))
    for o in (out, with_logits):  # fp32: the fused loss differs from CE over logits by summation order only
        torch.testing.assert_close(o.mtp_loss, expected_mtp, rtol=1e-6, atol=0)
        torch.testing.assert_close(o.lm_loss, expected_lm, rtol=1e-6, atol=0)
        torch.testing.assert_close(o.loss, o.lm_loss + 0.1 * o.mtp_loss + o.z_loss + o.aux_loss)


def test_without_mtp_loss_is_plain_next_token_ce():
    torch.manual_seed(2)
    model = LingForCausalLM(tiny(num_mtp_layers=0, z_loss_coef=0.0)).eval()
    ids = torch.randint(0, 257, (2, 16))
    labels = torch.randint(0, 257, (2, 16))
    labels[0, :3] = IGNORE_INDEX
    with torch.no_grad():
        out = model(ids, labels=labels, return_logits=True)
        fused = model(ids, labels=labels)
    assert out.mtp_logits == [] and out.mtp_loss is None
    expected = F.cross_entropy(out.logits.reshape(-1, 257).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    assert torch.equal(out.loss, expected)  # CE over returned logits: F.cross_entropy's mean bit for bit
    torch.testing.assert_close(fused.loss, expected, rtol=1e-6, atol=0)


def test_doc_ids_mask_attention_across_documents():
    torch.manual_seed(3)
    model = LingForCausalLM(tiny(num_mtp_layers=0)).eval()
    ids = torch.randint(0, 257, (1, 12))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        packed = model(ids, doc_ids=doc_ids).logits
        alone = model(ids[:, 5:]).logits  # the second document on its own, positions restart...
    # ...but RoPE positions do not restart in the packed row; attention is relative, so logits agree
    torch.testing.assert_close(packed[:, 5:], alone, atol=1e-4, rtol=1e-4)


def test_parameter_counts_match_published_ling_mini_2_0():
    counts = count_parameters(ModelConfig.preset("ling_mini_2_0"))
    assert abs(counts.total / 16.26e9 - 1) < 0.005, counts
    assert abs(counts.activated / 1.43e9 - 1) < 0.005, counts
    l6 = count_parameters(ModelConfig.preset("ling_mini_2_0_l6"))
    assert 5.4e9 < l6.total + l6.mtp < 5.8e9
    # the full-depth proxy: every shape of the real model but 64 experts, so the same activated parameters
    # except the router rows of the 192 missing experts (19 MoE layers x 192 x 2048)
    e64_cfg = ModelConfig.preset("ling_mini_2_0_e64")
    full_cfg = ModelConfig.preset("ling_mini_2_0")
    assert e64_cfg == full_cfg.replace(num_experts=64)
    assert e64_cfg.num_experts // e64_cfg.num_expert_groups == 8 and e64_cfg.topk_groups == 4
    e64 = count_parameters(e64_cfg)
    assert counts.activated - e64.activated == 19 * 192 * 2048
    assert abs(e64.total / 4.77e9 - 1) < 0.005, e64


def test_rope_rotates_half_of_head_dim_with_rotary_dim_denominator():
    rope = RotaryEmbedding(rotary_dim=8, base=600000.0)
    expected_inv = torch.tensor([1 / 600000.0 ** (2 * j / 8) for j in range(4)])
    torch.testing.assert_close(rope.inv_freq, expected_inv.float())
    x = torch.randn(1, 2, 5, 16)
    cos, sin = rope.cos_sin(torch.arange(5))
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])  # the second half passes through untouched
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # position 0: no rotation
    # rotate_half pairs (i, i + 4): norms of each pair are preserved
    pair = lambda t: t[..., :4] ** 2 + t[..., 4:8] ** 2  # noqa: E731
    torch.testing.assert_close(pair(y), pair(x))


def test_rmsnorm_computes_in_fp32_and_casts_before_gain():
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 64).bfloat16()
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(norm(x), norm.weight * ref)


@pytest.mark.slow
def test_overfits_a_fixed_small_batch():
    # near-zero losses give denormal gradients, which are ~50x slower on CPU: flush them for this test.
    # One thread: with two, the MoE dispatch's backward (an index_put with accumulate over repeated token ids)
    # sums in a scheduling-dependent order: three identical 80-step runs ended at 0.0007, 0.033 and 0.043, and
    # one full-suite run failed the 0.1 bound. One thread makes the run reproducible.
    threads = torch.get_num_threads()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    try:
        _overfit()
    finally:
        torch.set_flush_denormal(False)  # torch's default
        torch.set_num_threads(threads)


def _overfit():
    torch.manual_seed(0)
    model = LingForCausalLM(tiny(num_layers=2, bias_update_rate=0.0))
    ids = torch.randint(0, 257, (2, 32))
    labels = torch.roll(ids, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(80):
        out = model(ids, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else out.lm_loss.item()
    assert first > math.log(257) - 0.5
    assert out.lm_loss.item() < 0.1, out.lm_loss.item()


def test_gqa_matches_explicit_per_head_attention():
    """Query head h attends with KV head h // (heads / kv_heads): check against a hand-written loop."""
    torch.manual_seed(4)
    cfg = tiny()
    model = LingForCausalLM(cfg).eval()
    attn = model.layers[0].attention
    x = torch.randn(1, 6, cfg.hidden_size)
    cos, sin = model.rotary.cos_sin(torch.arange(6))
    with torch.no_grad():
        out = attn(x, cos, sin)
        qkv = attn.query_key_value(x)
        hd, H, KV = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q = qkv[..., : H * hd].view(1, 6, H, hd).transpose(1, 2)
        k = qkv[..., H * hd: (H + KV) * hd].view(1, 6, KV, hd).transpose(1, 2)
        v = qkv[..., (H + KV) * hd:].view(1, 6, KV, hd).transpose(1, 2)
        q = apply_rotary(attn.query_layernorm(q), cos, sin)
        k = apply_rotary(attn.key_layernorm(k), cos, sin)
        heads = []
        for h in range(H):
            kv = h // (H // KV)
            scores = q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(hd)
            scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
            heads.append(scores.softmax(-1) @ v[:, kv])
        ref = attn.dense(torch.stack(heads, 1).transpose(1, 2).reshape(1, 6, H * hd))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, key", [({"num_heads": 3}, "num_heads"), ({"num_kv_heads": 3}, "num_kv_heads"),
                                      ({"num_expert_groups": 5}, "num_expert_groups"),
                                      ({"topk_groups": 9}, "topk_groups"), ({"precision": "fp4"}, "precision")])
def test_bad_model_config_names_the_key(bad, key):
    with pytest.raises(ValueError, match=f"model.{key}"):
        ModelConfig.preset("tiny", **bad)


# ---------------------------------------------------------------- recomputation, host syncs
def _loss_and_grads(cfg: ModelConfig, ids, labels, doc_ids=None, seed=0):
    torch.manual_seed(seed)
    model = LingForCausalLM(cfg).train()
    out = model(ids, labels=labels, doc_ids=doc_ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_recompute_modes_give_identical_loss_and_gradients():
    # One thread: the MoE dispatch backward's accumulate order varies with two (see the overfit test).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(5)
        ids = torch.randint(0, 257, (2, 24))
        labels = torch.randint(0, 257, (2, 24))
        doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
        base = tiny(bias_update_rate=0.0)
        runs = {mode: _loss_and_grads(base.replace(recompute=mode), ids, labels, doc_ids)
                for mode in ("none", "selective", "full")}
        runs["alias"] = _loss_and_grads(base.replace(activation_checkpointing=True), ids, labels, doc_ids)
    finally:
        torch.set_num_threads(threads)
    loss, grads = runs["none"]
    assert len(grads) == sum(1 for _ in LingForCausalLM(base).parameters())
    for mode in ("selective", "full", "alias"):
        # recomputation replays the same CPU ops on the same inputs, in one thread: bit for bit
        assert torch.equal(runs[mode][0], loss), mode
        for name, g in grads.items():
            assert torch.equal(runs[mode][1][name], g), (mode, name)


class LiveTensors(TorchDispatchMode):
    """Keeps a weak reference to every tensor an op returns; `live_bytes()` sums the storages still alive
    (after a forward: what autograd and checkpoint keep for backward, plus the outputs), parameters excluded
    (views of them, e.g. one expert's weight, share their storage)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def live_bytes(self) -> int:
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(n for ptr, n in storages.items() if ptr not in self.params)


def test_selective_recompute_keeps_less_for_backward_than_none_and_more_than_full():
    """Bytes of activations alive after the forward, on a dense-only model (the routed experts' SwiGLU belongs to
    the grouped-experts function; a MoE model's figures are dominated by the routed rows)."""
    torch.manual_seed(6)
    ids = torch.randint(0, 257, (2, 64))
    labels = torch.randint(0, 257, (2, 64))
    kept = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = LingForCausalLM(tiny(num_layers=2, num_dense_layers=2, num_mtp_layers=0, recompute=mode)).train()
        with LiveTensors(model) as live:
            out = model(ids, labels=labels)
        gc.collect()
        kept[mode] = live.live_bytes()
        out.loss.backward()
    # measured (fp32, B=2, T=64): none 3.63 MB, selective 2.70 MB, full 0.47 MB. Selective keeps per layer the
    # QKV output (not the normed, rotated q/k nor SDPA's inputs) and gate_up (not silu(gate)).
    assert kept["selective"] < 0.85 * kept["none"], kept
    assert kept["full"] < 0.25 * kept["selective"], kept


def test_recompute_config_errors_name_the_key():
    with pytest.raises(ValueError, match="model.recompute"):
        ModelConfig.preset("tiny", recompute="some")
    with pytest.raises(ValueError, match="model.activation_checkpointing"):
        ModelConfig.preset("tiny", recompute="selective", activation_checkpointing=True)
    assert ModelConfig.preset("tiny", activation_checkpointing=True).recompute_mode == "full"


# Ops whose CUDA version makes the host wait: a value read back (.item(), bool(), int(), Python branches on
# tensors) or an output whose size depends on the data.
SYNCING_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.repeat_interleave.Tensor,
               torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default,
               torch.ops.aten.bincount.default}


class FailOnHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_OPS:
            raise AssertionError(f"{func} would synchronise the host with the GPU")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_forward_and_backward_outside_the_moe_have_no_host_sync(recompute, monkeypatch):
    """Structural check on CPU (the GPU twin uses torch.cuda.set_sync_debug_mode): a dense-only model without
    MTP (the MoE is checked on its own) runs forward + backward with no syncing op and no .tolist()."""
    def no_tolist(self):
        raise AssertionError(".tolist() synchronises the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_tolist)
    cfg = tiny(num_layers=2, num_dense_layers=2, num_mtp_layers=0, recompute=recompute)
    model = LingForCausalLM(cfg).train()
    ids = torch.randint(0, 257, (2, 24))
    labels = torch.randint(0, 257, (2, 24))
    labels[0, :5] = IGNORE_INDEX
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    for docs in (None, doc_ids):
        with FailOnHostSync():
            model(ids, labels=labels, doc_ids=docs).loss.backward()
    with FailOnHostSync():  # the BlockMask of the CUDA document path (flex itself has no CPU backward)
        document_block_mask(doc_ids)
    with FailOnHostSync():  # and the detector does catch a sync
        with pytest.raises(AssertionError, match="synchronise"):
            bool(labels.sum() > 0)


def test_cuda_graphs_on_cpu_tensors_are_refused_in_training_and_unused_without_gradients():
    """model.cuda_graphs (model/graphs.py) captures on CUDA only: a training forward on CPU names the key; a
    forward without gradients (eval) runs eagerly and gives the eager model's loss."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=64)
    eager = LingForCausalLM(cfg)
    graphed = LingForCausalLM(cfg.replace(cuda_graphs=True))
    graphed.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(ValueError, match="model.cuda_graphs needs CUDA tensors"):
        graphed(ids, labels=ids)
    with torch.no_grad():
        assert torch.equal(graphed(ids, labels=ids).loss, eager(ids, labels=ids).loss)
    graphed.eval()
    assert torch.equal(graphed(ids, labels=ids).loss, eager.eval()(ids, labels=ids).loss)
