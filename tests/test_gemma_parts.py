"""Gemma 3's and Gemma 4's plain single-device parts (models/gemma3.py, models/gemma4.py, models/layer_types.py)
against transformers on the same weights, in fp32: each part alone (norms, the scaled embedding, the rotary tables,
the router, the per-layer inputs, decoder layers of every kind), then whole tiny models assembled from the parts
(Assembly, below: test-only) against Gemma3ForCausalLM / Gemma4ForCausalLM, logits and every parameter's gradient,
on full rows, padded rows and packed rows (transformers on each document alone), through SDPA and eager attention.
The Gemma 4 configs cover per-layer embeddings (PLE), key/value sharing with double-wide MLPs, attention_k_eq_v with
its own global head count, the MoE block, and the final soft cap; a two-stage run passes the shared keys and values
and the embedded tokens between stages as a pipeline would, and returns their gradients."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import Gemma3TextConfig, Gemma4TextConfig
from transformers.models.gemma3.modeling_gemma3 import (Gemma3ForCausalLM, Gemma3RMSNorm as HFGemma3RMSNorm,
                                                        Gemma3TextScaledWordEmbedding)
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM, Gemma4RMSNorm as HFGemma4RMSNorm

from models.gemma3 import (Gemma3DecoderLayer, Gemma3RMSNorm, ScaledEmbedding, gemma3_embedding, gemma3_final_norm,
                           soft_cap, soft_cap_derivative)
from models.gemma4 import (Gemma4DecoderLayer, Gemma4RMSNorm, Gemma4Router, PerLayerInputs,
                           gemma4_embedding, gemma4_final_norm, kv_sources)
from models.architecture import check_gemma_line
from models.layer_types import layer_windows, masks_by_layer_type
from models.rotary import RotaryByLayerType
from tests.parts_parity import (BATCH, DOCUMENTS_ALONE_TOLERANCES, SEQ, VOCAB, check_grads, close, hf_grads, loss_of,
                                 reference_logits, reloaded, rows)

ALTERNATING = ["sliding_attention", "full_attention"] * 3


def gemma3_config(**overrides):
    """Six layers, two full; the sliding window (4) shorter than a row; the full layers' rotary with linear scaling;
    query_pre_attn_scalar away from head_dim."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
                  max_position_embeddings=64, sliding_window_pattern=3, rope_parameters={
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                      "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})
    return Gemma3TextConfig(**{**fields, **overrides})


def gemma4_config(**overrides):
    """Six layers alternating sliding and full (the full ones with their own head_dim, 16 against 8, and the
    proportional partial rotary); the sliding window (4) shorter than a row."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=4, max_position_embeddings=64,
                  layer_types=ALTERNATING, hidden_size_per_layer_input=0)
    return Gemma4TextConfig(**{**fields, **overrides})


PLE = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)
SHARED_KV = dict(num_kv_shared_layers=2, use_double_wide_mlp=True)  # layers 4, 5 reuse 2's and 3's
K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1)
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
CONFIGS = {
    "gemma3": lambda: gemma3_config(),
    "gemma3_soft_cap": lambda: gemma3_config(final_logit_softcapping=2.0),
    "gemma4_e2b": lambda: gemma4_config(**PLE, **SHARED_KV, final_logit_softcapping=2.0),  # E2B / E4B
    "gemma4_31b": lambda: gemma4_config(**K_EQ_V, final_logit_softcapping=30.0),  # 31B: k_eq_v, no PLE
    "gemma4_26b_a4b": lambda: gemma4_config(**K_EQ_V, **MOE, final_logit_softcapping=2.0),  # the MoE
    "gemma4_everything": lambda: gemma4_config(**PLE, **SHARED_KV, **K_EQ_V, **MOE, final_logit_softcapping=2.0),
}


def randomise(model):
    """Every weight away from its initial value (norms near their identity: 1 + w for Gemma 3, w for Gemma 4),
    and each layer_scalar buffer too, so that no part's mistake hides behind a zero or a one."""
    torch.manual_seed(0)
    offset = 0.0 if model.config.model_type == "gemma3_text" else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                param.copy_(offset + 0.3 * torch.randn_like(param))
            else:
                param.normal_(std=0.5 if "embed_tokens" in name else 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model


def reference(case, impl, dtype=torch.float32):
    """transformers' model of a case, randomised, in dtype (float64: its experts through their eager loop, the
    grouped GEMM taking no float64)."""
    config = CONFIGS[case]()
    config._attn_implementation = impl
    if dtype == torch.float64:
        config._experts_implementation = "eager"
    model = Gemma3ForCausalLM(config) if config.model_type == "gemma3_text" else Gemma4ForCausalLM(config)
    return randomise(model.to(dtype)).eval()


class Assembly(nn.Module):
    """A test-only model from the parts, as a pipeline stage holds them: decoder layers `layers` (a range), with
    the embedding on the first stage and the final norm, tied head and soft cap on the last. A Gemma 4 stage holds
    its layers' share of the per-layer inputs (PerLayerInputs) and receives what a pipeline sends between stages:
    the hidden states, the embedded tokens the per-layer inputs are projected from, the token, document and
    position ids, and the shared keys and values of source layers before it ({source layer: (k, v)})."""

    def __init__(self, config, layers, impl):
        super().__init__()
        self.config, self.gemma4 = config, config.model_type == "gemma4_text"
        self.first, self.last = layers.start == 0, layers.stop == config.num_hidden_layers
        self.layer_indices = layers
        decoder = Gemma4DecoderLayer if self.gemma4 else Gemma3DecoderLayer
        self.layers = nn.ModuleDict({str(i): decoder(config, i, impl) for i in layers})
        self.embed_tokens = (gemma4_embedding if self.gemma4 else gemma3_embedding)(config)  # the tied weight
        if self.last:
            self.norm = (gemma4_final_norm if self.gemma4 else gemma3_final_norm)(config)
        self.per_layer = PerLayerInputs(config, layers) if self.gemma4 and config.hidden_size_per_layer_input \
            else None
        self.rotary = RotaryByLayerType(config)
        self.windows = layer_windows(config)

    def load_from(self, hf_model):
        """This stage's weights out of transformers' model (the per-layer table cut to its columns)."""
        state = {name.removeprefix("model."): tensor for name, tensor in hf_model.state_dict().items()}
        for name, tensor in self.state_dict().items():
            inner = name.removeprefix("per_layer.")
            tensor.copy_(self.per_layer.share(inner, state[inner]) if inner != name else state[name])
        return self

    def forward(self, carry, packed=True):
        hidden = self.embed_tokens(carry["input_ids"]) if self.first else carry["hidden"]
        embedded = hidden if self.first else carry.get("embedded")
        document_ids, position_ids = carry["document_ids"], carry["position_ids"]
        tables = self.rotary(position_ids, hidden.dtype)
        masks = masks_by_layer_type(document_ids, self.windows, hidden.dtype, packed)
        per_layer = self.per_layer(carry["input_ids"], embedded) if self.per_layer is not None else None
        shared = dict(carry.get("shared", {}))
        for j, i in enumerate(self.layer_indices):
            layer = self.layers[str(i)]
            cos, sin = tables[layer.layer_type]
            mask = masks[layer.layer_type]
            if not self.gemma4:
                hidden = layer(hidden, cos, sin, mask)
                continue
            hidden, key_value, _ = layer(hidden, cos, sin, mask, None if per_layer is None else per_layer[:, :, j],
                                      shared.get(layer.kv_source))
            if layer.stores_kv:
                shared[i] = key_value
        if not self.last:
            return {**carry, "hidden": hidden, "embedded": embedded, "shared": shared}
        logits = F.linear(self.norm(hidden), self.embed_tokens.weight)
        return soft_cap(logits, self.config.final_logit_softcapping)


def assembled(hf_model, impl, stages=None):
    """The parts holding transformers' weights, as one stage or as the stages of the given layer ranges."""
    config = hf_model.config
    stages = stages or [range(config.num_hidden_layers)]
    with torch.no_grad():
        return [Assembly(config, layers, impl).to(hf_model.dtype).load_from(hf_model) for layers in stages]


def run(stages, carry, packed=True):
    for stage in stages:
        carry = stage(carry, packed)
    return carry


def assembled_grads(stages):
    """Each parameter's gradient under transformers' name: the per-layer table's shares put back together by
    columns and rows, and the copies of the shared per-layer norm (one per stage) summed as a tied weight's; the
    embedding's gradient, from every stage that uses it (first: lookup, last: tied head), summed likewise."""
    grads = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            if param.grad is None:
                continue
            name = name.removeprefix("per_layer.")
            split = PerLayerInputs.SPLIT_DIMS.get(name)
            if name not in grads:
                grads[name] = param.grad
            elif split is not None:
                grads[name] = torch.cat([grads[name], param.grad], dim=split)
            else:
                grads[name] = grads[name] + param.grad
    return grads


# ---- each part alone ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_transformers_to_the_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 16) * 4).to(dtype)
    theirs3, ours3 = HFGemma3RMSNorm(16, eps=1e-6), Gemma3RMSNorm(16, 1e-6)
    for theirs, ours in ((theirs3, ours3), (HFGemma4RMSNorm(16, eps=1e-6), Gemma4RMSNorm(16, 1e-6))):
        with torch.no_grad():
            theirs.weight.normal_()
        ours.load_state_dict(theirs.state_dict())
        assert torch.equal(ours.to(dtype)(x), theirs.to(dtype)(x))
    weightless = Gemma4RMSNorm(16, 1e-6, with_scale=False)
    assert not list(weightless.parameters())
    assert torch.equal(weightless(x), HFGemma4RMSNorm(16, eps=1e-6, with_scale=False)(x))
    assert torch.equal(Gemma3RMSNorm(16, 1e-6).weight, torch.zeros(16))  # (1 + w): zero-initialised


def test_scaled_embedding_rounds_its_scale_to_the_weight_dtype():
    """sqrt(3072) = 55.4256 is 55.5 in bf16: Gemma multiplies by the rounded value, as transformers does."""
    torch.manual_seed(0)
    theirs = Gemma3TextScaledWordEmbedding(5, 3072, 0, embed_scale=3072 ** 0.5).to(torch.bfloat16)
    ours = ScaledEmbedding(5, 3072, 0, 3072 ** 0.5).to(torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    ids = torch.tensor([[1, 2, 0, 4]])
    assert torch.equal(ours(ids), theirs(ids))
    assert torch.equal(ours(ids), ours.weight[ids] * 55.5)
    assert not torch.equal(ours(ids), (ours.weight[ids].float() * 3072 ** 0.5).to(torch.bfloat16))
    ours(ids).float().sum().backward()
    assert ours.weight.grad[0].abs().sum() == 0  # the pad row


@pytest.mark.parametrize("case", ["gemma3", "gemma4_31b"])
def test_rotary_tables_match_transformers(case):
    """Each layer type's tables: Gemma 3's linear scaling on the full layers, Gemma 4's proportional partial rotary
    over the full layers' own head_dim; positions restarting inside a row, as packed documents' do."""
    hf_model = reference(case, "sdpa")
    _, _, position_ids = rows("packed")
    ours = RotaryByLayerType(hf_model.config)(position_ids, torch.float32)
    x = torch.zeros(BATCH, SEQ, hf_model.config.hidden_size)
    for layer_type in ("sliding_attention", "full_attention"):
        cos, sin = hf_model.model.rotary_emb(x, position_ids, layer_type)
        assert torch.equal(ours[layer_type][0], cos) and torch.equal(ours[layer_type][1], sin)
    widths = {"gemma3": (16, 16), "gemma4_31b": (8, 16)}[case]  # each type's head_dim
    assert (ours["sliding_attention"][0].shape[-1], ours["full_attention"][0].shape[-1]) == widths


def test_rotary_refuses_length_dependent_types():
    config = gemma3_config(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                            "full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                               "rope_theta": 1e6}})
    with pytest.raises(ValueError, match=r"rope_parameters\['full_attention'\] rope_type 'dynamic' changes"):
        RotaryByLayerType(config)


def test_soft_cap_and_its_derivative():
    logits = torch.linspace(-80, 80, 41, requires_grad=True)
    capped = soft_cap(logits, 30.0)
    assert torch.equal(capped, torch.tanh(logits / 30.0) * 30.0)
    capped.sum().backward()
    assert torch.allclose(soft_cap_derivative(capped.detach(), 30.0), logits.grad, atol=1e-6)
    assert soft_cap(logits, None) is logits


def test_router_matches_transformers():
    hf_model = reference("gemma4_26b_a4b", "sdpa")
    theirs = hf_model.model.layers[0].router
    ours = Gemma4Router(hf_model.config)
    ours.load_state_dict(theirs.state_dict())
    hidden = torch.randn(20, 32) * 3
    for mine, reference_output in zip(ours(hidden), theirs(hidden)):
        assert torch.equal(mine, reference_output)


@pytest.mark.parametrize("split", [None, 2, 5], ids=["whole", "stages_2_4", "stages_5_1"])
def test_per_layer_inputs_match_transformers(split):
    """PLE restricted to a stage's layers equals those layers' slice of transformers' per-layer inputs."""
    hf_model = reference("gemma4_e2b", "sdpa")
    input_ids, _, _ = rows("full")
    embedded = hf_model.model.embed_tokens(input_ids)
    theirs = hf_model.model.project_per_layer_inputs(embedded, hf_model.model.get_per_layer_inputs(input_ids))
    state = {name.removeprefix("model."): t for name, t in hf_model.state_dict().items()}
    layers = hf_model.config.num_hidden_layers
    for share in ([range(layers)] if split is None else [range(split), range(split, layers)]):
        ours = PerLayerInputs(hf_model.config, share)
        ours.load_state_dict({name: ours.share(name, state[name]) for name in ours.state_dict()})
        assert close(ours(input_ids, embedded), theirs[:, :, share.start:share.stop], tol=1e-6)
        assert ours.embed_tokens_per_layer.weight.shape == (VOCAB, len(share) * 8)


def test_per_layer_inputs_refuse_a_config_without_them():
    with pytest.raises(ValueError, match="has no per-layer embeddings"):
        PerLayerInputs(gemma4_config())
    with pytest.raises(ValueError, match="give a non-empty range of consecutive layers"):
        PerLayerInputs(gemma4_config(**PLE), range(4, 7))


def test_gemma3_refuses_bidirectional_attention():
    with pytest.raises(ValueError, match="use_bidirectional_attention=True in the gemma3_text config"):
        Gemma3DecoderLayer(gemma3_config(use_bidirectional_attention=True), 0)


def test_kv_sources_and_refusals():
    assert kv_sources(gemma4_config(**SHARED_KV)) == {4: 2, 5: 3}
    assert kv_sources(gemma4_config()) == {}
    with pytest.raises(ValueError, match="num_kv_shared_layers=6 of 6 layers leaves no layer"):
        check_gemma_line(gemma4_config(num_kv_shared_layers=6))
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        check_gemma_line(gemma4_config(use_bidirectional_attention="all"))


def test_a_reusing_layer_refuses_to_run_without_the_shared_kv():
    config = gemma4_config(**SHARED_KV)
    layer = Gemma4DecoderLayer(config, 4)
    assert layer.reuses_kv and layer.kv_source == 2 and not hasattr(layer.self_attn, "k_proj")
    assert layer.mlp.gate_proj.out_features == 2 * config.intermediate_size  # double-wide
    cos = sin = torch.ones(1, 3, 8)
    with pytest.raises(ValueError, match="layer 4 reuses layer 2's keys and values: pass them as shared_kv"):
        layer(torch.randn(1, 3, 32), cos, sin, None)


@pytest.mark.parametrize("case", ["gemma3", "gemma4_everything"])
def test_decoder_layers_have_transformers_state_dicts(case):
    hf_model = reference(case, "sdpa")
    decoder = Gemma4DecoderLayer if case.startswith("gemma4") else Gemma3DecoderLayer
    for i, theirs in enumerate(hf_model.model.layers):
        ours = decoder(hf_model.config, i)
        assert {n: t.shape for n, t in ours.state_dict().items()} == \
            {n: t.shape for n, t in theirs.state_dict().items()}, i


@pytest.mark.parametrize("case", CONFIGS)
def test_decoder_layers_match_transformers(case):
    """Every layer alone on the same input, tables and packed-documents mask as transformers' layer: outputs and
    every weight's gradient; a reusing layer given the keys and values its source layer stored (transformers
    through its shared_kv_states), each per-layer input its slice."""
    hf_model = reference(case, "sdpa")
    config, gemma4 = hf_model.config, case.startswith("gemma4")
    torch.manual_seed(3)
    input_ids, document_ids, position_ids = rows("packed")
    hidden = torch.randn(BATCH, SEQ, config.hidden_size)
    tables = RotaryByLayerType(config)(position_ids, hidden.dtype)
    masks = masks_by_layer_type(document_ids, layer_windows(config), hidden.dtype)
    per_layer = torch.randn(BATCH, SEQ, config.num_hidden_layers, 8)
    theirs_shared, ours_shared = {}, {}
    for i, theirs in enumerate(hf_model.model.layers):
        ours = (Gemma4DecoderLayer if gemma4 else Gemma3DecoderLayer)(config, i)
        ours.load_state_dict(theirs.state_dict())
        layer_type = config.layer_types[i]
        cos, sin = tables[layer_type]
        kwargs = dict(position_embeddings=(cos, sin), attention_mask=masks[layer_type], position_ids=position_ids)
        if not gemma4:
            out, expected = ours(hidden, cos, sin, masks[layer_type]), theirs(hidden, **kwargs)
        else:
            ple = per_layer[:, :, i] if config.hidden_size_per_layer_input else None
            out, key_value, _ = ours(hidden, cos, sin, masks[layer_type], ple, ours_shared.get(ours.kv_source))
            expected = theirs(hidden, ple, shared_kv_states=theirs_shared, **kwargs)
            if ours.stores_kv:
                ours_shared[i] = key_value
        assert close(out, expected, 1e-6), i
        out.square().sum().backward(retain_graph=True)
        expected.square().sum().backward(retain_graph=True)
        for name, param in ours.named_parameters():
            assert close(param.grad, theirs.get_parameter(name).grad), (i, name)


# ---- whole models ----

def compare(case, impl, layout, dtype=torch.float32, logits_tol=1e-5, grads_tol=1e-5):
    hf_model = reference(case, impl, dtype)
    stages = assembled(hf_model, impl)
    input_ids, document_ids, position_ids = rows("packed" if layout == "documents" else layout)
    carry = dict(input_ids=input_ids, document_ids=document_ids, position_ids=position_ids)
    ours = run(stages, carry, packed=layout in ("packed", "documents")) * (document_ids != 0)[..., None]
    theirs = reference_logits(hf_model, input_ids, document_ids, position_ids, layout)
    assert close(ours, theirs, logits_tol), (ours - theirs).abs().max()
    loss_of(ours, document_ids).backward()
    loss_of(theirs, document_ids).backward()
    check_grads(assembled_grads(stages), hf_grads(hf_model), grads_tol)


@pytest.mark.parametrize("layout", ["full", "padded", "packed"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CONFIGS)
def test_assembled_model_matches_transformers(case, impl, layout):
    """Logits at every real token and every parameter's gradient within 1e-5 of transformers' in fp32. Padded rows
    run with no mask on the full layers (as a pipeline's padded layout), packed ones with the document mask against
    transformers' own packing."""
    compare(case, impl, layout)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CONFIGS)
def test_packed_rows_match_transformers_on_each_document_alone(case, impl):
    """Each document of a packed row as transformers computes it alone. In float64: in fp32 the two runs round
    their different shapes differently, by up to 5e-5 of these random models' logits, as much as transformers' own
    fp32 logits differ from its float64 ones. The gradients' tolerance is that of the fp32 sums inside the norms
    (x.float() in both); eager attention's, its fp32 softmax's (tests/parts_parity.py DOCUMENTS_ALONE_TOLERANCES)."""
    compare(case, impl, "documents", torch.float64, **DOCUMENTS_ALONE_TOLERANCES[impl])


def test_padded_rows_match_with_the_document_mask_too():
    hf_model = reference("gemma4_everything", "sdpa")
    input_ids, document_ids, position_ids = rows("padded")
    carry = dict(input_ids=input_ids, document_ids=document_ids, position_ids=position_ids)
    ours = run(assembled(hf_model, "sdpa"), carry, packed=True) * (document_ids != 0)[..., None]
    assert close(ours, reference_logits(hf_model, input_ids, document_ids, position_ids, "padded"))


@pytest.mark.parametrize("case", ["gemma4_e2b", "gemma4_everything"])
def test_two_stages_pass_shared_kv_and_embeddings_with_their_gradients(case):
    """Layers 0-2 on one stage, 3-5 on the next: layer 2's keys and values (which layer 4 reuses) and the embedded
    tokens cross the boundary as a pipeline sends them (detached, then given their gradient back), the per-layer
    table split by columns; logits and every gradient as transformers'."""
    hf_model = reference(case, "sdpa")
    first, second = assembled(hf_model, "sdpa", [range(3), range(3, 6)])
    input_ids, document_ids, position_ids = rows("packed")
    sent = first(dict(input_ids=input_ids, document_ids=document_ids, position_ids=position_ids))
    assert list(sent["shared"]) == [2]  # layer 3 stores its own, on the second stage
    floating = [sent["hidden"], sent["embedded"], *sent["shared"][2]]
    received = [t.detach().requires_grad_() for t in floating]
    logits = second({**sent, "hidden": received[0], "embedded": received[1], "shared": {2: tuple(received[2:])}})
    logits = logits * (document_ids != 0)[..., None]
    theirs = reference_logits(hf_model, input_ids, document_ids, position_ids, "packed")
    assert close(logits, theirs)
    loss_of(logits, document_ids).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in received)
    torch.autograd.backward(floating, [t.grad for t in received])
    loss_of(theirs, document_ids).backward()
    check_grads(assembled_grads([first, second]), hf_grads(hf_model))


@pytest.mark.parametrize("case", ["gemma3", "gemma4_e2b", "gemma4_everything"])
def test_bf16_logits_equal_transformers(case, tmp_path):
    """The whole model in bf16, loaded as a user loads a checkpoint, to the bit: the embedding scales rounded to
    bf16, the norms in fp32, the rotary tables cast to bf16, the router in fp32."""
    hf_model = reloaded(reference(case, "sdpa"), torch.bfloat16, tmp_path)
    input_ids, document_ids, position_ids = rows("packed")
    carry = dict(input_ids=input_ids, document_ids=document_ids, position_ids=position_ids)
    ours = run(assembled(hf_model, "sdpa"), carry) * (document_ids != 0)[..., None]
    assert torch.equal(ours, reference_logits(hf_model, input_ids, document_ids, position_ids, "packed"))
