"""The hybrids' full attention and norms against transformers on the same weights, in one process: GatedAttention
(models/gated_attention.py) against Qwen3_5Attention and Qwen3NextAttention (SDPA and eager, with and without
biases), outputs and the input's and every weight's gradients in fp32 within 1e-5; a packed row against each document
alone; the rotary tables, the offset and gated RMSNorms (models/offset_norms.py) bit-identical, fp32 and bf16."""
import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5Attention, Qwen3_5RMSNorm, Qwen3_5RMSNormGated,
                                                          Qwen3_5TextRotaryEmbedding)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

from models.attention import AttentionInputs
from models.attention_kernels import additive_mask
from models.gated_attention import GatedAttention
from models.rotary import RotaryEmbedding
from models.offset_norms import GatedRMSNorm, OffsetRMSNorm

FAMILIES = {"qwen3_5": (Qwen3_5TextConfig, Qwen3_5Attention, Qwen3_5TextRotaryEmbedding),
            "qwen3_next": (Qwen3NextConfig, Qwen3NextAttention, Qwen3NextRotaryEmbedding)}


def tiny_config(family, **overrides):
    """4 query heads over 2 key/value heads of 16 features, the first quarter of them rotary (theta 1e7)."""
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                  max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                                "partial_rotary_factor": 0.25})
    return FAMILIES[family][0](**{**fields, **overrides})


def theirs_tables(family, config, x, positions):
    """transformers' rotary tables for text positions [B, S] (Qwen3.5's takes its three position rows)."""
    rotary = FAMILIES[family][2](config)
    return rotary(x, positions[None].expand(3, *positions.shape) if family == "qwen3_5" else positions)


def random_attentions(family, impl, bias):
    config = tiny_config(family, attention_bias=bias)
    config._attn_implementation = impl
    torch.manual_seed(0)
    reference = FAMILIES[family][1](config, layer_idx=1)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.normal_(std=0.3 if "norm" in name else 0.2)
    ours = GatedAttention.from_config(config, impl)
    ours.load_state_dict(reference.state_dict())
    return config, reference, ours


def assert_close(ours, theirs, msg=None):
    """Within 1e-5 of transformers, relative to the tensor's largest magnitude."""
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * max(1.0, theirs.abs().max().item()), msg=msg)


def attention_and_grads(module, x, upstream, *args):
    module.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    out = module(leaf, *args)
    out = out[0] if isinstance(out, tuple) else out
    (out * upstream).sum().backward()
    return out, leaf.grad, {name: param.grad for name, param in module.named_parameters()}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "attention_bias"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gated_attention_matches_transformers(family, impl, bias):
    config, reference, ours = random_attentions(family, impl, bias)
    generator = torch.Generator().manual_seed(1)
    x, upstream = torch.randn(2, 24, 32, generator=generator), torch.randn(2, 24, 32, generator=generator)
    positions = torch.arange(24).expand(2, 24)
    cos, sin = RotaryEmbedding(config)(x, positions)
    theirs_cos, theirs_sin = theirs_tables(family, config, x, positions)
    assert cos.shape[-1] == 4 and torch.equal(cos, theirs_cos) and torch.equal(sin, theirs_sin)
    causal = additive_mask(torch.ones(24, 24, dtype=torch.bool).tril()[None, None], x.dtype)
    out, x_grad, grads = attention_and_grads(ours, x, upstream, AttentionInputs(cos, sin, None))
    expected, expected_x_grad, expected_grads = attention_and_grads(
        reference, x, upstream, (theirs_cos, theirs_sin), causal if impl == "eager" else None)
    assert_close(out, expected)
    assert_close(x_grad, expected_x_grad)
    assert set(grads) == set(expected_grads)
    for name in grads:
        assert_close(grads[name], expected_grads[name], msg=name)


def packed_mask(ids):
    """The additive mask of packed documents (ids [B, S], 0 on padding): causal within each document, padding
    seeing only itself, as the pipeline's stage inputs build it."""
    seq = ids.shape[-1]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril() & (ids[:, None, :, None] == ids[:, None, None, :])
    return additive_mask((allowed & (ids != 0)[:, None, None, :]) | torch.eye(seq, dtype=torch.bool), torch.float32)


def test_a_packed_row_equals_each_document_alone():
    """Documents of 9, 10 and 5 tokens (positions restarting at each), then padding, under the mask of packed
    documents: each document's outputs and input gradients as transformers' on it alone."""
    config, reference, ours = random_attentions("qwen3_5", "sdpa", False)
    ids = torch.tensor([[1] * 9 + [2] * 10 + [3] * 5 + [0] * 4])
    positions = torch.cat([torch.arange(9), torch.arange(10), torch.arange(5), torch.arange(4)])[None]
    generator = torch.Generator().manual_seed(1)
    x, upstream = torch.randn(1, 28, 32, generator=generator), torch.randn(1, 28, 32, generator=generator)
    upstream[:, 24:] = 0  # padding's outputs are nobody's
    cos, sin = RotaryEmbedding(config)(x, positions)
    out, x_grad, _ = attention_and_grads(ours, x, upstream, AttentionInputs(cos, sin, packed_mask(ids)))
    for span in (slice(0, 9), slice(9, 19), slice(19, 24)):
        alone = x[:, span]
        tables = theirs_tables("qwen3_5", config, alone, torch.arange(span.stop - span.start)[None])
        expected, expected_x_grad, _ = attention_and_grads(reference, alone, upstream[:, span], tables, None)
        assert_close(out[:, span], expected)
        assert_close(x_grad[:, span], expected_x_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_are_transformers_bit_for_bit(dtype):
    """The offset norm (weights in the model's dtype), the gated norm with its weight in fp32 beside bf16 inputs, as
    Qwen3.5 stores it: the same bits, forward and backward."""
    generator = torch.Generator().manual_seed(0)
    x, gate = (torch.randn(6, 5, 16, generator=generator).to(dtype) for _ in range(2))
    for ours, theirs, args in ((OffsetRMSNorm(16, 1e-6), Qwen3_5RMSNorm(16, 1e-6), (x,)),
                               (GatedRMSNorm(16, 1e-6), Qwen3_5RMSNormGated(16, eps=1e-6), (x, gate))):
        with torch.no_grad():
            theirs.weight.normal_(generator=generator)
        theirs.to(dtype if isinstance(theirs, Qwen3_5RMSNorm) else torch.float32)
        ours.to(theirs.weight.dtype).load_state_dict(theirs.state_dict())
        results = []
        for module in (ours, theirs):
            leaves = [a.clone().requires_grad_() for a in args]
            out = module(*leaves)
            out.float().sum().backward()
            results.append([out, module.weight.grad, *(leaf.grad for leaf in leaves)])
        assert results[0][0].dtype == dtype
        for mine, reference in zip(*results):
            assert torch.equal(mine, reference)
