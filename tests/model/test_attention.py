"""Attention paths: SDPA's enable_gqa equals the repeat_interleave reference; FlexAttention with the
document-causal BlockMask equals the dense-mask reference; selective recomputation of the core is exact."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.layers import (
    Attention,
    RotaryEmbedding,
    attend,
    attention_mask,
    document_block_mask,
    document_causal_mask,
    reference_attention,
)


def qkv(B=2, H=4, KV=2, T=40, D=16, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda heads: torch.randn(B, heads, T, D, generator=g).to(device, dtype).requires_grad_(True)  # noqa: E731
    return make(H), make(KV), make(KV)


def packed_doc_ids(B=2, T=40, device="cpu"):
    """Rows of packed documents, lengths not aligned to anything (one row is a single document)."""
    lengths = [[7, 1, 20, 12], [40]]
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths[:B]]
    return torch.stack(rows).to(device)


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return torch.autograd.grad(out, inputs, g)


def test_enable_gqa_equals_repeated_kv_forward_and_backward():
    q, k, v = qkv()
    ours = attend(q, k, v, None)
    ref = reference_attention(q, k, v, None)
    # CPU: the GQA call runs SDPA's math kernel, the repeated one its flash kernel: same maths, other sum order
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads(ours, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU on purpose
def test_flex_block_mask_equals_dense_document_mask_forward():
    # FlexAttention has no CPU backward (torch 2.13): forward here, gradients in the GPU test below
    q, k, v = (t.detach() for t in qkv())
    doc_ids = packed_doc_ids()
    flex = attend(q, k, v, document_block_mask(doc_ids))
    dense = reference_attention(q, k, v, document_causal_mask(doc_ids))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("T, eos_rate", [(512, 0.002), (512, 0.03), (1024, 0.01), (384, 0.2)])
def test_block_mask_from_document_bounds_equals_create_block_mask(T, eos_rate):
    """The BlockMask built from each block's first/last document id is create_block_mask's, table for table
    (partial and full blocks, both directions, same order), and attention through it is bit-identical. Rows:
    random EOS positions, one document starting exactly at a block boundary, one single-document row."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g = torch.Generator().manual_seed(T + int(1000 * eos_rate))
    is_eos = (torch.rand(3, T, generator=g) < eos_rate).long()
    is_eos[1] = 0
    is_eos[1, 127] = is_eos[1, 255] = 1  # documents [0, 128), [128, 256), [256, T): boundaries on blocks
    is_eos[2] = 0
    doc_ids = torch.cumsum(is_eos, 1) - is_eos  # as the loader makes them (EOS closes its document)
    ours = document_block_mask(doc_ids)

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    ref = create_block_mask(document_causal, 3, None, T, T, device="cpu")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    q, k, v = (torch.randn(3, 2, T, 32, generator=g) for _ in range(3))
    assert torch.equal(flex_attention(q, k, v, block_mask=ours), flex_attention(q, k, v, block_mask=ref))


def test_attention_mask_choice_and_flex_training_on_cpu_fails_naming_the_key():
    doc_ids = packed_doc_ids()
    cfg = ModelConfig.preset("tiny", vocab_size=64)
    assert attention_mask(None, cfg) is None
    assert attention_mask(doc_ids, cfg).dtype == torch.bool  # auto on CPU: the dense mask
    flex_cfg = cfg.replace(document_attention="flex")
    with pytest.raises(ValueError, match="model.document_attention"):
        attention_mask(doc_ids, flex_cfg)
    with torch.no_grad():
        assert not isinstance(attention_mask(doc_ids, flex_cfg), torch.Tensor)
    with pytest.raises(ValueError, match="model.document_attention"):
        ModelConfig.preset("tiny", document_attention="varlen")


def attention_layer(cfg: ModelConfig, seed=0) -> Attention:
    torch.manual_seed(seed)
    layer = Attention(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    return layer


@pytest.mark.parametrize("with_docs", [False, True])
def test_selective_recompute_of_the_core_gives_identical_outputs_and_gradients(with_docs):
    cfg = ModelConfig.preset("tiny", vocab_size=64)
    plain, selective = attention_layer(cfg), attention_layer(cfg.replace(recompute="selective"))
    selective.load_state_dict(plain.state_dict())
    x = torch.randn(2, 40, cfg.hidden_size, requires_grad=True)
    cos, sin = RotaryEmbedding(cfg.rotary_dim, cfg.rope_base).cos_sin(torch.arange(40))
    mask = attention_mask(packed_doc_ids(), cfg) if with_docs else None
    outs = [layer(x, cos, sin, mask) for layer in (plain, selective)]
    assert torch.equal(outs[0], outs[1])
    g = [grads(o, (x, *layer.parameters())) for o, layer in zip(outs, (plain, selective))]
    for a, b in zip(*g):  # the recomputation replays the same CPU ops on the same inputs: bit for bit
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_flex_document_attention_matches_dense_forward_and_backward():
    B, H, KV, T, D = 2, 16, 4, 2048, 128
    q, k, v = qkv(B, H, KV, T, D, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    doc_ids = torch.cumsum(torch.rand(B, T, generator=g) < 3e-3, dim=1).cuda()  # ~6 documents per row
    flex = attend(q, k, v, document_block_mask(doc_ids))
    # reference in fp32 (math kernel on the dense mask); both bf16 kernels are compared against it
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = reference_attention(q32, k32, v32, document_causal_mask(doc_ids))
    dense = reference_attention(q, k, v, document_causal_mask(doc_ids))

    def err(a, b):
        return float((a.float() - b).norm() / b.norm())

    ref_grads = grads(ref, (q32, k32, v32))
    # bf16 inputs/outputs: ~0.4 % relative error per kernel (bf16 rounding of P and O); flex must not be
    # worse than the dense bf16 kernel by more than a factor 1.5
    assert err(flex, ref) < 1.5 * err(dense, ref) + 1e-3
    for a, b, r in zip(grads(flex, (q, k, v)), grads(dense, (q, k, v)), ref_grads):
        assert err(a, r) < 1.5 * err(b, r) + 1e-3


@pytest.mark.gpu
def test_gpu_causal_gqa_runs_on_the_flash_kernel_without_kv_copy():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv(1, 16, 4, 4096, 128, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot take enable_gqa
        out = attend(q, k, v, None)
        out.sum().backward()
        ref = reference_attention(q.detach(), k.detach(), v.detach(), None)
    # flash with enable_gqa packs a KV group's query heads together, another accumulation order than flash on
    # repeated K/V: bf16-rounding differences (H200: max 1.1e-3 absolute on 6.8 % of elements)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 5e-3
