"""A model of any supported family as one torch module on one device, built from the same parts as the pipeline's
layers: the oracle-facing unit, which a test compares with transformers directly.

    from models import from_hf
    model = from_hf("/models/Llama-3.2-1B")        # a Hugging Face directory: config.json and its weights
    logits = model(input_ids, attention_mask)

Its parameters are named as transformers names them (`model.layers.0.self_attn.q_proj.weight`), but Phi-3's fused
projections are held as their parts and a mixture's experts fused, as the pipeline holds both (models/layout.py).
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from models.architecture import architecture_of, check_model_config
from models.attention import StageAttentionInputs
from models.decoder import DecoderLayer
from models.hf_weights import find_weight_files, hf_tensors, layer_states, text_model_tensors
from models.layout import text_config_of
from models.moe import RoutedTokens
from models.norms import RMSNorm
from models.sigmoid_router import FP32_MARKER


class DecoderStack(nn.Module):
    """transformers' `model`: the embedding, the decoder layers and the final norm."""

    def __init__(self, config, attention_impl):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, index, attention_impl)
                                    for index in range(config.num_hidden_layers))
        architecture = architecture_of(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_fp32=architecture.norm_scale_in_fp32,
                            offset=architecture.offset_norms)


class CausalLM(nn.Module):
    """The decoder and its LM head (the embedding's weight when tied)."""

    def __init__(self, config, attention_impl="sdpa"):
        super().__init__()
        check_model_config(config)
        self.config = config
        architecture = architecture_of(config)
        self.embedding_multiplier, self.logits_multiplier = (architecture.embedding_multiplier,
                                                             1 / architecture.logits_scaling)
        self.model = DecoderStack(config, attention_impl)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Padded rows take a mask per row, full ones none (models/attention.py StageAttentionInputs). The rotary
        # tables are computed on the host, even when the model is built on the meta device, and follow the hidden
        # states to theirs.
        with torch.device("cpu"):
            self.inputs_of = {layout: StageAttentionInputs(config, layout) for layout in ("packed", "full")}

    def forward(self, input_ids, attention_mask=None, document_ids=None, position_ids=None):
        """Logits (batch, seq, vocab) of input_ids (batch, seq); attention_mask: 1 on the tokens, 0 on padding
        (transformers'), None for rows without padding. Packed rows instead: document_ids (0 on padding, k on a
        row's k-th document) and position_ids (batch, seq), as the pipeline's collator gives them."""
        batch, seq = input_ids.shape
        packed = attention_mask is not None or document_ids is not None
        if document_ids is None:
            document_ids = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        positions = (torch.arange(seq, device=input_ids.device).expand(batch, seq) if position_ids is None
                     else position_ids)
        inputs_of = self.inputs_of["packed" if packed else "full"]
        hidden = self.model.embed_tokens(input_ids)
        hidden = hidden if self.embedding_multiplier == 1 else hidden * self.embedding_multiplier
        tokens = RoutedTokens.of(document_ids)
        for layer in self.model.layers:
            hidden, _ = layer(hidden, inputs_of(hidden, document_ids, positions, layer.window), tokens)
        hidden = self.model.norm(hidden)
        hidden = hidden if self.logits_multiplier == 1 else hidden * self.logits_multiplier
        return F.linear(hidden, self.head_weight)

    @property
    def head_weight(self):
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def pipeline_layers(self):
        """{pipeline layer index (models/layout.py): the module holding that layer's weights}."""
        layers = {0: self.model.embed_tokens, self.config.num_hidden_layers + 1: self.model.norm}
        layers.update({index + 1: layer for index, layer in enumerate(self.model.layers)})
        if not self.config.tie_word_embeddings:
            layers[self.config.num_hidden_layers + 2] = self.lm_head
        return layers


def from_hf(path, dtype=None, attention_impl="sdpa"):
    """The CausalLM of a Hugging Face directory (config.json and safetensors or .bin weights, sharded or not), its
    weights read through conversion's name map, in evaluation mode: of a multimodal checkpoint (Qwen3.5's), its
    text model, the towers and MTP layer left out. dtype: what to cast the weights to (None: as stored);
    DeepSeek-V3's router stays fp32, as transformers keeps it."""
    hub_config = AutoConfig.from_pretrained(path)
    check_model_config(hub_config)
    config = text_config_of(hub_config)
    with torch.device("meta"):
        model = CausalLM(config, attention_impl)
    states = layer_states(text_model_tensors(hf_tensors(find_weight_files(path)), hub_config), config)
    for index, module in model.pipeline_layers().items():
        targets = module.state_dict(keep_vars=True)
        state = {key: tensor if dtype is None or getattr(targets.get(key), FP32_MARKER, False)
                 or not tensor.is_floating_point() else tensor.to(dtype)
                 for key, tensor in states.get(index, {}).items()}
        module.load_state_dict(state, strict=True, assign=True)
    return model.eval()
