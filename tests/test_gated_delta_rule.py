"""Gated DeltaNet's parts against transformers on the same weights and inputs, in one process: the chunked gated delta
rule (models/gated_delta_rule.py) against torch_chunk_gated_delta_rule, and the linear-attention mixer
(models/linear_attention.py) against Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet and Qwen3NextGatedDeltaNet;
outputs, final states, the inputs' and every weight's gradients, fp32 within 1e-5. In bf16 the rule's math is fp32
(the bf16 result is the fp32 one, cast). Packed rows against transformers on each document alone (its torch path
cannot take packed rows); padded rows against transformers' masked rows; a row split in stretches, the state and the
convolution's inputs carried from each to the next, against the whole row."""
import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, torch_chunk_gated_delta_rule
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from models.gated_delta_rule import chunk_gated_delta_rule, state_transition
from models.linear_attention import GatedDeltaNet, fuse_projections, split_fused_projections



def assert_close(ours, theirs, msg=None, tolerance=1e-5):
    """Within `tolerance` of transformers, relative to the tensor's largest magnitude (gradients of the tiny
    modules' random weights reach hundreds)."""
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance * max(1.0, theirs.abs().max().item()),
                               msg=None if msg is None else lambda detail: f"{msg}: {detail}")


# Two rows of 200 tokens: documents ending inside a chunk, on a chunk's boundary (64), one token long, padding at
# the end; and a row of a 64-token document then one of 136.
PACKED = ([(1, 70), (2, 30), (3, 28), (4, 1), (5, 61), (0, 10)], [(1, 64), (2, 136)])


def document_ids(rows):
    """[len(rows), S]: each row's (document id, length) runs, in order."""
    return torch.stack([torch.cat([torch.full((length,), doc) for doc, length in row]) for row in rows])


def runs(ids):
    """[(row, document id, slice)] of each real document of document ids [B, S]."""
    found = []
    for row in range(ids.shape[0]):
        for doc in ids[row].unique().tolist():
            positions = (ids[row] == doc).nonzero()[:, 0]
            if doc:
                found.append((row, doc, slice(positions[0].item(), positions[-1].item() + 1)))
    return found


def rule_inputs(batch, seq, key_heads=2, value_heads=4, key_dim=16, value_dim=8, seed=0):
    """q, k, v, g, beta and an initial state as Gated DeltaNet makes them: g = -exp(A_log) softplus(a + dt_bias)
    with A_log's initial spread (decays from near 1 to e^-30 a token), beta a sigmoid."""
    generator = torch.Generator().manual_seed(seed)
    normal = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    a_log = torch.empty(value_heads).uniform_(0.01, 16, generator=generator).log()
    g = -a_log.exp() * torch.nn.functional.softplus(normal(batch, seq, value_heads) + 1.0)
    return (normal(batch, seq, key_heads, key_dim), normal(batch, seq, key_heads, key_dim),
            normal(batch, seq, value_heads, value_dim), g, normal(batch, seq, value_heads).sigmoid(),
            normal(batch, value_heads, key_dim, value_dim))


def rule_and_grads(rule, inputs, upstream, initial=True, **kwargs):
    """(output, final state, the gradient of each input) of `rule`, backward from upstream's weights."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, state = rule(*leaves[:5], initial_state=leaves[5] if initial else None, output_final_state=True, **kwargs)
    loss = (out.float() * upstream[0]).sum() + (state * upstream[1]).sum()
    loss.backward()
    return [out, state] + [leaf.grad for leaf in leaves[:6 if initial else 5]]


def upstream_of(batch, seq, value_heads=4, key_dim=16, value_dim=8):
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(batch, seq, value_heads, value_dim, generator=generator),
            torch.randn(batch, value_heads, key_dim, value_dim, generator=generator))


OUTPUTS = ("output", "final state", "q", "k", "v", "g", "beta", "initial state")  # rule_and_grads', in order


def transformers_rule(*args, **kwargs):
    return torch_chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True, **kwargs)


@pytest.mark.parametrize("seq", [150, 128], ids=["partial_chunk", "whole_chunks"])
@pytest.mark.parametrize("key_heads", [2, 4], ids=["grouped_values", "one_key_a_value"])
@pytest.mark.parametrize("initial", [True, False], ids=["initial_state", "zero_state"])
def test_rule_matches_transformers(seq, key_heads, initial):
    inputs = rule_inputs(2, seq, key_heads=key_heads)
    upstream = upstream_of(2, seq)
    expected = rule_and_grads(transformers_rule, inputs, upstream, initial)
    got = rule_and_grads(chunk_gated_delta_rule, inputs, upstream, initial)
    for name, ours, theirs in zip(OUTPUTS, got, expected):
        assert_close(ours, theirs, msg=name)


def test_rule_in_bf16_is_its_fp32_math_cast():
    """bf16 inputs: the output is the fp32 rule's on the same (bf16) values, cast to bf16, and so is transformers'
    (both cast q, k, v, g, beta to fp32 first); the state fp32."""
    inputs = [x.to(torch.bfloat16) for x in rule_inputs(2, 150)[:5]]
    out, state = chunk_gated_delta_rule(*inputs, output_final_state=True)
    out32, state32 = chunk_gated_delta_rule(*(x.float() for x in inputs), output_final_state=True)
    theirs, theirs_state = transformers_rule(*inputs, output_final_state=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert torch.equal(out, out32.to(torch.bfloat16)) and torch.equal(state, state32)
    assert_close(state, theirs_state)
    torch.testing.assert_close(out.float(), theirs.float(), atol=1e-5, rtol=2 ** -7)  # a rounding apart at most


def test_packed_documents_equal_each_document_alone():
    ids = document_ids(PACKED)
    inputs = rule_inputs(2, ids.shape[1])[:5]
    upstream = upstream_of(2, ids.shape[1])[0]
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, _ = chunk_gated_delta_rule(*leaves, document_ids=ids)
    (out * upstream).sum().backward()
    for row, doc, span in runs(ids):
        alone = [x[row:row + 1, span].clone().requires_grad_() for x in inputs]
        expected, _ = transformers_rule(*alone)
        (expected * upstream[row:row + 1, span]).sum().backward()
        assert_close(out[row:row + 1, span], expected, msg=f"row {row} document {doc}")
        for name, leaf, theirs in zip("q k v g beta".split(), leaves, alone):
            assert_close(leaf.grad[row:row + 1, span], theirs.grad, 
                                       msg=f"row {row} document {doc}: {name}")


@pytest.mark.parametrize("split", [100, 64, 1], ids=["inside_a_chunk", "on_a_chunk_boundary", "after_one_token"])
def test_a_sequence_split_in_two_with_the_state_carried_equals_the_whole(split):
    inputs = rule_inputs(2, 230)
    upstream = upstream_of(2, 230)
    whole = rule_and_grads(chunk_gated_delta_rule, inputs, upstream)
    leaves = [x.clone().requires_grad_() for x in inputs]
    first, carried = chunk_gated_delta_rule(*(x[:, :split] for x in leaves[:5]), initial_state=leaves[5],
                                            output_final_state=True)
    second, final = chunk_gated_delta_rule(*(x[:, split:] for x in leaves[:5]), initial_state=carried,
                                           output_final_state=True)
    out = torch.cat([first, second], dim=1)
    ((out * upstream[0]).sum() + (final * upstream[1]).sum()).backward()
    for name, ours, theirs in zip(OUTPUTS, [out, final] + [leaf.grad for leaf in leaves], whole):
        assert_close(ours, theirs, msg=name)


def test_the_final_state_is_affine_in_the_initial_one():
    """final(S0) = M S0 + final(0), M = state_transition: a later stretch's initial state composes from the earlier
    stretches' (M, final(0)) without running them in turn; a document starting inside the stretch cuts it (M = 0)."""
    q, k, v, g, beta, initial = rule_inputs(2, 150)
    g = g * 0.01  # decays a stretch of 150 tokens leaves above fp32's resolution
    ids = document_ids([[(1, 150)], [(1, 90), (2, 60)]])
    transition = state_transition(q, k, g, beta, ids)
    _, from_zero = chunk_gated_delta_rule(q, k, v, g, beta, ids, output_final_state=True)
    _, final = chunk_gated_delta_rule(q, k, v, g, beta, ids, initial, output_final_state=True)
    assert_close(final, transition @ initial + from_zero)
    assert transition[0].abs().max() > 1e-3 and torch.equal(transition[1], torch.zeros_like(transition[1]))


# The mixer

# The mixers' A = exp(A_log), one a value head: decays from e^-0.03 to e^-10 a token (at a + dt_bias = 0).
MIXER_DECAYS = (0.05, 0.5, 3.0, 14.0)
# dt_bias's and A_log's gradients are sums over every token of terms of both signs and carry that sum's fp32 rounding:
# transformers' own lies about 2e-5 of their scale from the same computation in fp64 on these mixers, as ours does.
SUMMED_OVER_TOKENS = ("dt_bias", "A_log")


FAMILIES = {"qwen3_5": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet), "qwen3_5_moe": (Qwen3_5MoeTextConfig,
                                                                               Qwen3_5MoeGatedDeltaNet),
            "qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet)}  # (config, transformers' mixer)


def tiny_config(family="qwen3_5", **overrides):
    """A tiny hybrid config: 2 key heads of 16 features serving 4 value heads of 8, a kernel of 4."""
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"], max_position_embeddings=256)
    return FAMILIES[family][0](**{**fields, **overrides})


def random_mixers(family="qwen3_5", dtype=torch.float32):
    """transformers' mixer with random weights (A_log: MIXER_DECAYS) and ours holding the same (Qwen3-Next's fused
    projections split); in bf16, A_log and the gated norm's weight stay fp32, as Qwen3.5's checkpoints store them."""
    config = tiny_config(family)
    torch.manual_seed(0)
    reference = FAMILIES[family][1](config, layer_idx=0)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name == "norm.weight":
                param.normal_(1.0, 0.2)
            elif name == "A_log":
                param.copy_(torch.tensor(MIXER_DECAYS).log())
            else:
                param.normal_(std=0.5 if name in ("conv1d.weight", "dt_bias") else 0.2)
    state = reference.state_dict()
    if family == "qwen3_next":
        sizes = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                 config.linear_value_head_dim)
        qkv, z, b, a = split_fused_projections(state.pop("in_proj_qkvz.weight"), state.pop("in_proj_ba.weight"),
                                               *sizes)
        state.update({"in_proj_qkv.weight": qkv, "in_proj_z.weight": z, "in_proj_b.weight": b,
                      "in_proj_a.weight": a})
    ours = GatedDeltaNet.from_config(config)
    ours.load_state_dict(state)
    for module in (reference, ours):
        module.to(dtype)
        module.A_log.data, module.norm.weight.data = module.A_log.data.float(), module.norm.weight.data.float()
    return reference, ours


def hidden_states(batch, seq, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, 32, generator=generator).to(dtype), \
        torch.randn(batch, seq, 32, generator=generator).to(dtype)


def mixer_and_grads(module, x, upstream, **kwargs):
    """(output, the input's gradient, {weight name: gradient}) of one forward and backward."""
    module.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    out = module(leaf, **kwargs)
    (out.float() * upstream.float()).sum().backward()
    return out, leaf.grad, {name: param.grad for name, param in module.named_parameters()}


def fused_grads(grads, config):
    """Our mixer's weight gradients with the split projections' fused again, by Qwen3-Next's names."""
    grads = dict(grads)
    sizes = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)
    grads["in_proj_qkvz.weight"], grads["in_proj_ba.weight"] = fuse_projections(
        *(grads.pop(f"in_proj_{part}.weight") for part in ("qkv", "z", "b", "a")), *sizes)
    return grads


def assert_grads_close(ours, theirs):
    assert set(ours) == set(theirs)
    for name in theirs:
        assert_close(ours[name], theirs[name], msg=name, tolerance=4e-5 if name in SUMMED_OVER_TOKENS else 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixer_matches_transformers(family):
    reference, ours = random_mixers(family)
    x, upstream = hidden_states(2, 150)
    out, x_grad, grads = mixer_and_grads(ours, x, upstream)
    expected, expected_x_grad, expected_grads = mixer_and_grads(reference, x, upstream)
    assert_close(out, expected)
    assert_close(x_grad, expected_x_grad)
    assert_grads_close(fused_grads(grads, tiny_config(family)) if family == "qwen3_next" else grads, expected_grads)


def test_mixer_in_bf16_matches_transformers_to_its_rounding():
    """bf16 weights, with A_log and the gated norm's weight in fp32 (as Qwen3.5 stores them): outputs and gradients
    in each weight's own dtype, as transformers', and as close to its as bf16's rounding leaves them."""
    reference, ours = random_mixers(dtype=torch.bfloat16)
    x, upstream = hidden_states(2, 150, torch.bfloat16)
    out, x_grad, grads = mixer_and_grads(ours, x, upstream)
    expected, expected_x_grad, expected_grads = mixer_and_grads(reference, x, upstream)
    assert out.dtype == x_grad.dtype == torch.bfloat16
    assert {name: g.dtype for name, g in grads.items()} == {name: g.dtype for name, g in expected_grads.items()}
    assert grads["A_log"].dtype == grads["norm.weight"].dtype == torch.float32
    assert_close(out, expected, tolerance=2e-2)  # a few bf16 roundings (2^-8 each) apart
    assert_close(x_grad, expected_x_grad, tolerance=2e-2)
    for name in expected_grads:
        assert_close(grads[name], expected_grads[name], msg=name, tolerance=2e-2)


def test_padded_rows_equal_transformers_masked_rows():
    """A right-padded and a left-padded row: document ids 0 on padding against transformers' attention mask, at
    every position (padding's outputs are zeros in both)."""
    reference, ours = random_mixers()
    x, upstream = hidden_states(2, 90)
    mask = torch.ones(2, 90, dtype=torch.long)
    mask[0, 70:], mask[1, :25] = 0, 0
    out, x_grad, grads = mixer_and_grads(ours, x, upstream, document_ids=mask)
    expected, expected_x_grad, expected_grads = mixer_and_grads(reference, x, upstream, attention_mask=mask)
    assert_close(out, expected)
    assert_close(x_grad, expected_x_grad)
    assert_grads_close(grads, expected_grads)
    assert torch.equal(out[0, 70:], torch.zeros_like(out[0, 70:]))


def test_packed_rows_equal_transformers_on_each_document_alone():
    reference, ours = random_mixers()
    ids = document_ids(PACKED)
    x, upstream = hidden_states(2, ids.shape[1])
    out, x_grad, grads = mixer_and_grads(ours, x, upstream, document_ids=ids)
    summed = {}
    for row, doc, span in runs(ids):
        alone = x[row:row + 1, span]
        expected, expected_x_grad, expected_grads = mixer_and_grads(reference, alone, upstream[row:row + 1, span])
        assert_close(out[row:row + 1, span], expected, msg=f"row {row} document {doc}")
        assert_close(x_grad[row:row + 1, span], expected_x_grad, 
                                   msg=f"row {row} document {doc}")
        summed = {name: grad + summed.get(name, 0) for name, grad in expected_grads.items()}
    assert_grads_close(grads, summed)
    assert torch.equal(out[0, -10:], torch.zeros_like(out[0, -10:]))  # the padding


@pytest.mark.parametrize("splits", [[50], [70], [72], [2], [60, 62]], ids=[
    "inside_a_document", "on_a_document_boundary", "within_the_kernel_after_a_boundary", "shorter_than_the_kernel",
    "three_stretches_the_middle_one_shorter_than_the_kernel"])
def test_a_row_in_stretches_with_the_carry_equals_the_whole_row(splits):
    """The carry (the convolution's last inputs with their documents, the state) takes each stretch of a row on from
    the one before: outputs and gradients (the input's, every weight's) as the whole row's; a document starting at or
    just after a split restarts the window and the state there."""
    _, ours = random_mixers()
    ids = document_ids([[(1, 70), (2, 80)], [(1, 150)]])
    x, upstream = hidden_states(2, 150)
    out, x_grad, grads = mixer_and_grads(ours, x, upstream, document_ids=ids)
    ours.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    outputs, carry = [], None
    for start, end in zip([0, *splits], [*splits, 150]):
        stretch, carry = ours.forward_carrying(leaf[:, start:end], ids[:, start:end], carry)
        outputs.append(stretch)
    stretches = torch.cat(outputs, dim=1)
    (stretches * upstream).sum().backward()
    assert_close(stretches, out)
    assert_close(leaf.grad, x_grad)
    assert_grads_close({name: param.grad for name, param in ours.named_parameters()}, grads)


def test_rows_of_one_document_each_carry_without_document_ids():
    _, ours = random_mixers()
    x, _ = hidden_states(2, 150)
    first, carry = ours.forward_carrying(x[:, :100])
    second, _ = ours.forward_carrying(x[:, 100:], carry=carry)
    assert_close(torch.cat([first, second], dim=1), ours(x))


def test_qwen3_next_fused_projections_split_and_fuse_back_bit_identical():
    config = tiny_config("qwen3_next")
    reference = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    sizes = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)
    qkvz, ba = reference.in_proj_qkvz.weight.detach(), reference.in_proj_ba.weight.detach()
    parts = split_fused_projections(qkvz, ba, *sizes)
    assert [tuple(p.shape) for p in parts] == [(64 + 32, 32), (32, 32), (4, 32), (4, 32)]
    fused = fuse_projections(*parts, *sizes)
    assert torch.equal(fused[0], qkvz) and torch.equal(fused[1], ba)


def test_value_heads_not_a_multiple_of_key_heads_are_refused():
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(6\) is not a multiple of linear_num_key_heads "
                                         r"\(4\)"):
        GatedDeltaNet(32, 4, 6, 16, 8, 4)
    q, k, v, g, beta, _ = rule_inputs(1, 10, key_heads=4, value_heads=6)
    with pytest.raises(ValueError, match="6 value heads are not a multiple of 4 key heads"):
        chunk_gated_delta_rule(q, k, v, g, beta)


def test_the_cuda_kernels_path_calls_fla_as_its_api_takes_it():
    """DeltaRuleCore.with_kernels (the path CUDA takes with flash-linear-attention installed) on the CPU, with
    stand-ins honouring fla's chunk_gated_delta_rule and causal-conv1d's causal_conv1d_fn contracts (the rule over
    each cu_seqlens sequence of the flattened rows from a zero state, q and k normalised in the kernel, as many key
    as value heads; the convolution over channels-first input, restarting where seq_idx changes): equal to the torch
    path on packed rows with padding and on rows without document ids."""
    from models.gated_delta_rule import chunk_gated_delta_rule as torch_rule
    from models.linear_attention import causal_conv1d, document_segments

    def rule(q, k, v, g, beta, cu_seqlens=None, use_qk_l2norm_in_kernel=False):
        assert use_qk_l2norm_in_kernel and q.shape[2] == v.shape[2]
        if cu_seqlens is None:
            return torch_rule(q, k, v, g, beta)
        assert q.shape[0] == 1 and cu_seqlens[-1] == q.shape[1] and cu_seqlens.dtype == torch.long
        bounds = cu_seqlens.tolist()
        return torch.cat([torch_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])[0]
                          for a, b in zip(bounds[:-1], bounds[1:])], dim=1), None

    def conv(x, weight, bias=None, seq_idx=None, activation=None):
        assert bias is None and activation == "silu" and weight.dim() == 2
        ids = None if seq_idx is None else seq_idx.long() + 1
        return causal_conv1d(x.transpose(1, 2), weight[:, None], ids).transpose(1, 2)

    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 16, 8, 4)
    batch, seq = 2, 150
    qkv = torch.randn(batch, seq, 2 * 32 + 32)
    g = -torch.rand(batch, seq, 4) * 0.2
    beta = torch.rand(batch, seq, 4)
    ids = torch.tensor([[1] * 70 + [2] * 60 + [0] * 20, [1] * 3 + [2] * 100 + [3] * 47])
    assert document_segments(ids)[0, [0, 69, 70, 130, 149]].tolist() == [0, 0, 1, 2, 2]
    for document_ids in (ids, None):
        expected, _ = layer.core(qkv, layer.conv1d.weight, g, beta, document_ids)
        for kernels in ((rule, conv), (rule, None)):
            got = layer.core.with_kernels(kernels, qkv, layer.conv1d.weight, g, beta, document_ids)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
