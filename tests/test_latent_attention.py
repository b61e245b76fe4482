"""The attentions of the DeepSeek-V3 line against transformers' on the same weights, one module in one process:
outputs, the input's gradient and every weight's gradient in fp32, SDPA and eager, causal and a packed-documents
mask. Multi-head latent attention (models/latent_attention.py) against DeepseekV3Attention, with and without the
query latent (q_lora_rank), DeepSeek's interleaved rotary layout or the halves one, YaRN with mscale and
mscale_all_dim (the softmax scale and the rotary tables), biases; GLM-4.5's (models/attention.py's Attention with
its options) against Glm4MoeAttention: partial rotary, q/k/v biases without o's, with and without use_qk_norm."""
import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeAttention, Glm4MoeRotaryEmbedding

from models.attention import Attention, StageAttentionInputs
from models.attention_kernels import additive_mask
from models.latent_attention import LatentAttention, softmax_scale

BATCH, SEQ = 2, 12
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 1.1,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}


def mla_config(**overrides):
    """A tiny DeepSeek-V3 attention: 4 heads of 12 + 8 query/key features and 10 value features."""
    fields = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                  kv_lora_rank=12, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=64,
                  num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return DeepseekV3Config(**{**fields, **overrides})


def glm_config(**overrides):
    """A tiny GLM-4.5 attention: 4 query heads, 2 key/value heads of 16 features, half of them rotary."""
    fields = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, num_hidden_layers=2, attention_bias=True, rms_norm_eps=1e-5)
    return Glm4MoeConfig(**{**fields, **overrides})


FAMILIES = {  # (transformers' attention, its rotary embedding, ours)
    "deepseek_v3": (DeepseekV3Attention, DeepseekV3RotaryEmbedding, LatentAttention),
    "glm4_moe": (Glm4MoeAttention, Glm4MoeRotaryEmbedding, Attention),
}


def random_attention(config, impl):
    """transformers' attention with random weights (norms and biases too), and ours holding the same."""
    torch.manual_seed(0)
    config._attn_implementation = impl
    theirs, _, ours = FAMILIES[config.model_type]
    reference = theirs(config, layer_idx=0)
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(std=0.3)
    ours = ours(config, impl)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def document_ids():
    """Two rows: one of two documents and padding, one full document."""
    ids = torch.ones(BATCH, SEQ, dtype=torch.long)
    ids[0, 5:10], ids[0, 10:] = 2, 0
    return ids


CASES = {
    "q_lora_interleaved_yarn": lambda: mla_config(rope_parameters=YARN),
    "q_proj_interleaved": lambda: mla_config(q_lora_rank=None),
    "q_lora_halves_bias": lambda: mla_config(rope_interleave=False, attention_bias=True),
    "q_proj_halves_yarn": lambda: mla_config(q_lora_rank=None, rope_interleave=False, rope_parameters=YARN),
    "glm4_moe_qk_norm": lambda: glm_config(use_qk_norm=True),
    "glm4_moe": lambda: glm_config(),
}


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CASES)
def test_latent_attention_matches_transformers(case, impl, masked):
    config = CASES[case]()
    reference, ours = random_attention(config, impl)
    document = document_ids() if masked else torch.ones(BATCH, SEQ, dtype=torch.long)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    x = torch.randn(BATCH, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(1))
    stage_inputs = StageAttentionInputs(config, row_layout="packed" if masked else "full")
    inputs = stage_inputs(x, document, positions)
    cos, sin, mask, _ = inputs
    theirs_cos, theirs_sin = FAMILIES[config.model_type][1](config)(x, positions)
    assert torch.equal(cos, theirs_cos) and torch.equal(sin, theirs_sin)

    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(x_ours, inputs)
    mask_ref = mask
    if mask is None and impl == "eager":  # transformers' eager attention is causal only through its mask
        mask_ref = additive_mask(torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None], x.dtype)
    expected, _ = reference(x_ref, (theirs_cos, theirs_sin), mask_ref)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-5, rtol=0)
    theirs = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, atol=1e-5, rtol=1e-5, msg=name)
    assert {n for n, _ in ours.named_parameters()} == set(theirs)


def test_softmax_scale_is_transformers():
    for rope in (YARN, {**YARN, "mscale_all_dim": 0}, {"rope_type": "default", "rope_theta": 10000.0}):
        config = mla_config(rope_parameters=rope)
        assert softmax_scale(config) == DeepseekV3Attention(config, 0).scaling
    assert softmax_scale(mla_config(rope_parameters=YARN)) != 20 ** -0.5  # the YaRN case moves it


SPLITS = {  # name: (tensor parallel, sequence parallel, context parallel, documents masked, q_lora_rank)
    "tp2": (2, False, 1, True, 16),
    "tp2_sp_q_proj": (2, True, 1, True, None),
    "cp2_documents": (1, False, 2, True, 16),
    "cp2_causal_q_proj": (1, False, 2, False, None),  # no mask: the CPU's lower-right kernel, values padded
}


def split_worker(rank, out_dir):
    """MLA split over 2 ranks (heads under tensor parallelism, tokens under context parallelism) against the
    whole module on the same weights: this rank's outputs, its tokens' input gradient, and every weight's gradient
    (context parallelism: each rank's covers its own queries, so their sum over the group), as max differences."""
    import json

    import torch.distributed as dist

    from cluster.distributed import init_distributed
    from models.context_parallel import ContextParallel, ContextParallelAttentionInputs, ContextParallelCore
    from models.tensor_parallel import TensorParallel, parallelize
    init_distributed(timeout_minutes=2)
    errors = {}
    for name, (tensor, sequence, context_size, masked, q_rank) in SPLITS.items():
        config = mla_config(rope_parameters=YARN, q_lora_rank=q_rank, attention_bias=True)
        reference, whole = random_attention(config, "sdpa")
        parallel = TensorParallel(tensor, rank, sequence, group=dist.group.WORLD)
        context = ContextParallel(context_size, rank, dist.group.WORLD) if context_size > 1 else None
        ours = LatentAttention(config, "sdpa")
        parallelize(ours, parallel)
        if context:
            ours.core = ContextParallelCore(ours.core, context)
        ours.load_state_dict({n: t.chunk(tensor, getattr(p, "tensor_parallel_dim", 0))[rank]
                              if hasattr(p, "tensor_parallel_dim") else t
                              for (n, t), p in zip(whole.state_dict().items(), ours.parameters())})
        document = document_ids() if masked else torch.ones(BATCH, SEQ, dtype=torch.long)
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        x = torch.randn(BATCH, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(1))
        upstream = torch.randn(BATCH, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(2))
        x_whole = x.clone().requires_grad_()
        inputs = StageAttentionInputs(config, row_layout="packed" if masked else "full")(x, document, positions)
        (whole(x_whole, inputs) * upstream).sum().backward()
        out_whole = whole(x, inputs).detach()

        mine = (lambda t: t.reshape(BATCH * SEQ, -1).chunk(tensor)[rank]) if sequence else \
            (lambda t: context.local_tokens(t)) if context else (lambda t: t)
        x_mine = mine(x).clone().requires_grad_()
        layout = "packed" if masked else "full"
        stage_inputs = (ContextParallelAttentionInputs(config, context, layout) if context
                        else StageAttentionInputs(config, layout))
        out = ours(x_mine, stage_inputs(x_mine, *(context.local_tokens(t) if context else t
                                                  for t in (document, positions))))
        (out * mine(upstream)).sum().backward()
        grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
        if context:
            for grad in grads.values():
                dist.all_reduce(grad)
        whole_grads = dict(whole.named_parameters())
        errors[name] = {
            "out": (out - mine(out_whole)).abs().max().item(),
            "input_grad": (x_mine.grad - mine(x_whole.grad)).abs().max().item(),
            **{n: (g - (whole_grads[n].grad.chunk(tensor, p.tensor_parallel_dim)[rank]
                        if hasattr(p, "tensor_parallel_dim") else whole_grads[n].grad)).abs().max().item()
               for (n, g), p in zip(grads.items(), ours.parameters())}}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(errors, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_latent_attention_split_over_heads_and_tokens(tmp_path):
    import json

    from tests.distributed import spawn
    spawn(split_worker, 2, str(tmp_path))
    for rank in range(2):
        errors = json.load(open(tmp_path / f"rank{rank}.json"))
        assert set(errors) == set(SPLITS)
        for name, by_tensor in errors.items():
            bad = {t: e for t, e in by_tensor.items() if not e < 1e-5}
            assert not bad, f"rank {rank}, {name}: {bad}"
