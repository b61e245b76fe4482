"""OLMo 3's plain single-device parts (models/olmo3.py, models/layer_types.py) against transformers'
Olmo3ForCausalLM on the same weights: each decoder layer alone, then a whole tiny model assembled from the parts
(test-only), logits and every parameter's gradient in fp32 on full, padded and packed rows (against transformers'
own packing, and in float64 against each document alone), SDPA and eager; the full layers' YaRN next to the
sliding layers' plain rotary; and bf16, where OLMo 3 keeps its rotary tables and rotation in fp32."""
import pytest
import torch
from torch import nn
from transformers import Olmo3Config
from transformers.models.olmo3.modeling_olmo3 import Olmo3ForCausalLM

from models.layer_types import layer_windows, masks_by_layer_type
from models.rotary import RotaryByLayerType
from models.olmo3 import Olmo3DecoderLayer, olmo3_final_norm
from tests.parts_parity import (BATCH, DOCUMENTS_ALONE_TOLERANCES, SEQ, VOCAB, check_grads, close, hf_grads, loss_of,
                                 reference_logits, reloaded, rows)


def olmo3_config(**overrides):
    """Four layers (three sliding, one full, as transformers' default pattern), the window (4) shorter than a row,
    grouped-query attention."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=4, max_position_embeddings=64, pad_token_id=None,
                  bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    return Olmo3Config(**{**fields, **overrides})


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "rope_theta": 500000.0}
CONFIGS = {
    "olmo3": lambda: olmo3_config(),
    # OLMo 3's long-context checkpoints: YaRN on the full layers only, biases on (attention_bias)
    "olmo3_yarn": lambda: olmo3_config(attention_bias=True, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}, "full_attention": YARN}),
    "olmo3_tied": lambda: olmo3_config(tie_word_embeddings=True, num_hidden_layers=8),  # two full layers
}


def reference(case, impl, dtype=torch.float32):
    config = CONFIGS[case]()
    config._attn_implementation = impl
    model = Olmo3ForCausalLM(config).to(dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(std=0.5 if "embed_tokens" in name else 0.2)
    return model.eval()


class Assembly(nn.Module):
    """A test-only model from the parts: embedding, decoder layers, final norm, LM head (tied or not)."""

    def __init__(self, config, impl):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(Olmo3DecoderLayer(config, i, impl) for i in range(config.num_hidden_layers))
        self.norm = olmo3_final_norm(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryByLayerType(config)
        self.windows = layer_windows(config)

    def forward(self, input_ids, document_ids, position_ids, packed=True):
        hidden = self.embed_tokens(input_ids)
        tables = self.rotary(position_ids, torch.float32)
        masks = masks_by_layer_type(document_ids, self.windows, hidden.dtype, packed)
        for layer in self.layers:
            hidden = layer(hidden, *tables[layer.layer_type], masks[layer.layer_type])
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return nn.functional.linear(self.norm(hidden), head.weight)


def assembled(hf_model, impl):
    state = {name.removeprefix("model."): tensor for name, tensor in hf_model.state_dict().items()}
    ours = Assembly(hf_model.config, impl).to(hf_model.dtype)
    ours.load_state_dict({name: state[name] for name in ours.state_dict()})
    return ours


def test_layer_types_and_windows():
    config = olmo3_config(num_hidden_layers=8)
    windows = [Olmo3DecoderLayer(config, i).window for i in range(8)]
    assert windows == [4, 4, 4, None, 4, 4, 4, None]


@pytest.mark.parametrize("case", CONFIGS)
def test_rotary_tables_match_transformers(case):
    hf_model = reference(case, "sdpa")
    _, _, position_ids = rows("packed")
    ours = RotaryByLayerType(hf_model.config)(position_ids, torch.float32)
    for layer_type in ("sliding_attention", "full_attention"):
        cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), position_ids, layer_type)
        assert cos.dtype == torch.float32  # OLMo 3's tables stay in fp32, whatever the hidden states' dtype
        assert torch.equal(ours[layer_type][0], cos) and torch.equal(ours[layer_type][1], sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CONFIGS)
def test_decoder_layers_match_transformers(case, dtype):
    """Every layer alone on the same input, tables and packed-documents mask: outputs (bf16: to the bit, the
    rotation in fp32 as transformers') and every weight's gradient."""
    hf_model = reference(case, "sdpa", dtype)
    config = hf_model.config
    torch.manual_seed(3)
    _, document_ids, position_ids = rows("packed")
    hidden = torch.randn(BATCH, SEQ, config.hidden_size, dtype=dtype)
    tables = RotaryByLayerType(config)(position_ids, torch.float32)
    masks = masks_by_layer_type(document_ids, layer_windows(config), dtype)
    for i, theirs in enumerate(hf_model.model.layers):
        ours = Olmo3DecoderLayer(config, i).to(dtype)
        ours.load_state_dict(theirs.state_dict())
        layer_type = config.layer_types[i]
        out = ours(hidden, *tables[layer_type], masks[layer_type])
        expected = theirs(hidden, attention_mask=masks[layer_type], position_embeddings=tables[layer_type],
                          position_ids=position_ids)
        if dtype == torch.bfloat16:
            assert torch.equal(out, expected), i
            continue
        assert close(out, expected, 1e-6), i
        out.square().sum().backward()
        expected.square().sum().backward()
        for name, param in ours.named_parameters():
            assert close(param.grad, theirs.get_parameter(name).grad), (i, name)


def compare(case, impl, layout, dtype=torch.float32, logits_tol=1e-5, grads_tol=1e-5):
    hf_model = reference(case, impl, dtype)
    ours_model = assembled(hf_model, impl)
    input_ids, document_ids, position_ids = rows("packed" if layout == "documents" else layout)
    real = (document_ids != 0)[..., None]
    ours = ours_model(input_ids, document_ids, position_ids, packed=layout in ("packed", "documents")) * real
    theirs = reference_logits(hf_model, input_ids, document_ids, position_ids, layout)
    assert close(ours, theirs, logits_tol), (ours - theirs).abs().max()
    loss_of(ours, document_ids).backward()
    loss_of(theirs, document_ids).backward()
    ours_grads = {name: p.grad for name, p in ours_model.named_parameters() if p.grad is not None}
    check_grads(ours_grads, hf_grads(hf_model), grads_tol)


@pytest.mark.parametrize("layout", ["full", "padded", "packed"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CONFIGS)
def test_assembled_model_matches_transformers(case, impl, layout):
    """Logits at every real token and every parameter's gradient within 1e-5 of transformers' in fp32: padded rows
    with no mask on the full layers, packed rows with the document mask against transformers' own packing."""
    compare(case, impl, layout)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CONFIGS)
def test_packed_rows_match_transformers_on_each_document_alone(case, impl):
    """In float64, where two runs of different shapes round alike (tests/test_gemma_parts.py says why); the
    gradients to the fp32 sums inside the norms, eager attention to its fp32 softmax's rounding
    (tests/parts_parity.py DOCUMENTS_ALONE_TOLERANCES)."""
    compare(case, impl, "documents", torch.float64, **DOCUMENTS_ALONE_TOLERANCES[impl])


@pytest.mark.parametrize("case", CONFIGS)
def test_bf16_logits_equal_transformers(case, tmp_path):
    """The whole model in bf16, to the bit: the rotary tables and rotation in fp32, the norms scaling before the
    cast back."""
    hf_model = reloaded(reference(case, "sdpa"), torch.bfloat16, tmp_path)
    input_ids, document_ids, position_ids = rows("full")
    ours = assembled(hf_model, "sdpa")(input_ids, document_ids, position_ids, packed=False)
    assert torch.equal(ours, hf_model(input_ids=input_ids, use_cache=False).logits)
