"""A decoder layer: its family's token mixer and feed-forward, each inside a residual connection, with the family's
norms where it places them.

    hidden = hidden + multiplier * after(mixer(before(hidden)))       (each of before / after a norm, or none)
    hidden = hidden + multiplier * after(feed_forward(before(hidden)))

NORM_PLACEMENTS names the norms each placement has, as the family's transformers layer names them, so the layer's
state dict is the Hugging Face one after the `model.layers.{i}.` prefix.

Gemma 3 and Gemma 4 have decoder layers of their own (models/gemma3.py, gemma4.py), which share little with this
one; DECODER_LAYERS holds each under the call every model's layer takes, forward(hidden, inputs, tokens) ->
(hidden, routing statistics or None), Gemma 4's with what its layers exchange besides (Gemma4Decoder).
"""
import functools

from torch import nn

from models.architecture import (ATTENTION, COMPOSED, GATED_ATTENTION, GEMMA3, GEMMA4, LATENT_ATTENTION,
                                 LINEAR_ATTENTION, POST_NORMS, PRE_NORMS, architecture_of)
from models.attention import Attention
from models.gated_attention import GatedAttention
from models.gemma3 import Gemma3DecoderLayer, gemma3_final_norm
from models.gemma4 import Gemma4DecoderLayer, PerLayerInputs, gemma4_final_norm
from models.latent_attention import LatentAttention
from models.linear_attention import FusedGatedDeltaNet, GatedDeltaNet
from models.mlp import MLP
from models.moe import MoEBlock, routing_statistics
from models.norms import RMSNorm


def gated_attention(config, attention_impl="sdpa", layer_index=0):
    return GatedAttention.from_config(config, attention_impl)


def linear_attention(config, attention_impl="sdpa", layer_index=0):
    """Qwen3.5's GatedDeltaNet, or Qwen3-Next's with its fused projections."""
    fused = architecture_of(config).fused_linear_projections
    return (FusedGatedDeltaNet if fused else GatedDeltaNet).from_config(config)


# {token mixer: its module, built as module(config, attention_impl, layer_index)}; it sits in the layer under the
# name transformers gives it (MIXER_NAMES, else self_attn)
TOKEN_MIXERS = {ATTENTION: Attention, LATENT_ATTENTION: LatentAttention, GATED_ATTENTION: gated_attention,
                LINEAR_ATTENTION: linear_attention}
MIXER_NAMES = {LINEAR_ATTENTION: "linear_attn"}
# placement: ((norm before the token mixer, after it), (before the feed-forward, after it)), None where there is none
NORM_PLACEMENTS = {
    PRE_NORMS: (("input_layernorm", None), ("post_attention_layernorm", None)),  # LLaMA
    POST_NORMS: ((None, "post_attention_layernorm"), (None, "post_feedforward_layernorm")),  # OLMo 2
}


class DecoderLayer(nn.Module):
    """Decoder layer `layer_index` of a model: its token mixer is `self_attn` (a hybrid's linear attention
    `linear_attn`), its feed-forward `mlp` (an MoE block on the family's sparse layers), as transformers names
    them."""

    def __init__(self, config, layer_index=0, attention_impl="sdpa"):
        super().__init__()
        architecture = architecture_of(config)
        self.residual_multiplier = architecture.residual_multiplier
        self.sparse = architecture.sparse_layers[layer_index]
        norm = functools.partial(RMSNorm, config.hidden_size, config.rms_norm_eps,
                                 scale_in_fp32=architecture.norm_scale_in_fp32, offset=architecture.offset_norms)
        self.norm_names = NORM_PLACEMENTS[architecture.norm_placement]
        (before_mixer, after_mixer), (before_feed_forward, after_feed_forward) = self.norm_names
        self.add_norm(before_mixer, norm)
        self.mixer_kind = architecture.mixer_layers[layer_index]
        self.mixer_name = MIXER_NAMES.get(self.mixer_kind, "self_attn")
        self.add_module(self.mixer_name, TOKEN_MIXERS[self.mixer_kind](config, attention_impl, layer_index))
        self.window = getattr(self.token_mixer, "window", None)  # the positions its attention sees (None: all)
        self.add_norm(after_mixer, norm)
        self.add_norm(before_feed_forward, norm)
        self.mlp = MoEBlock(config) if self.sparse else MLP(config)
        self.add_norm(after_feed_forward, norm)

    def add_norm(self, name, norm):
        if name is not None:
            self.add_module(name, norm())

    def forward(self, hidden, inputs, tokens=None):
        """(the new hidden states, this layer's routing statistics or None). inputs: the batch's AttentionInputs;
        tokens: its RoutedTokens, which a sparse layer's router reads."""
        (before_mixer, after_mixer), (before_feed_forward, after_feed_forward) = self.norm_names
        attention = self.mix(self.normed(before_mixer, hidden), inputs)
        hidden = hidden + self.scaled(self.normed(after_mixer, attention))
        x = self.normed(before_feed_forward, hidden)
        out, statistics = self.mlp(x, tokens) if self.sparse else (self.mlp(x), None)
        return hidden + self.scaled(self.normed(after_feed_forward, out)), statistics

    @property
    def token_mixer(self):
        return getattr(self, self.mixer_name)

    def mix(self, x, inputs):
        """The token mixer's output; linear attention reads the rows' document ids where attention reads a mask."""
        if self.mixer_kind == LINEAR_ATTENTION:
            return self.linear_attn(x, inputs.document_ids, inputs.rows)
        return self.self_attn(x, inputs)

    def normed(self, name, x):
        return x if name is None else getattr(self, name)(x)

    def scaled(self, x):
        """x times the residual multiplier (Granite's); x itself, with no kernel, at 1."""
        return x if self.residual_multiplier == 1 else x * self.residual_multiplier


class OwnDecoder:
    """What a family's own decoder layer shows the plans applied from outside (LoRA's projections) as the composed
    layer does: its token mixer, which is its attention."""

    @property
    def token_mixer(self):
        return self.self_attn


class Gemma3Decoder(OwnDecoder, Gemma3DecoderLayer):
    """Gemma 3's decoder layer (models/gemma3.py) under every layer's call; it has no experts."""
    sparse = False

    def forward(self, hidden, inputs, tokens=None):
        return super().forward(hidden, inputs.cos, inputs.sin, inputs.mask), None


class Gemma4Decoder(OwnDecoder, Gemma4DecoderLayer):
    """Gemma 4's decoder layer (models/gemma4.py) under every layer's call, with what a Gemma 4 layer takes and
    gives besides: the token ids and the model's first hidden states (`embedded`), which its per-layer input is
    computed from, and the keys and values a reusing layer takes (shared_kv), or a storing layer gives:

        forward(hidden, inputs, tokens=None, input_ids=None, embedded=None, shared_kv=None)
            -> (hidden, routing statistics or None, key_value)

    With per-layer embeddings it holds its own share of them, this layer's columns of the per-layer table and rows
    of its projection (`per_layer_inputs`, models/layout.py places them in the layer's file), so that a pipeline
    stage holds only its layers'; the per-layer norm they share is copied into every layer, a tied weight. An MoE
    layer's statistics are its top-k counts (transformers computes no auxiliary loss for Gemma 4)."""

    def __init__(self, config, layer_index=0, attention_impl="sdpa"):
        super().__init__(config, layer_index, attention_impl)
        self.sparse = self.moe
        self.experts_config = architecture_of(config).moe
        if self.per_layer_width:
            self.per_layer_inputs = PerLayerInputs(config, range(layer_index, layer_index + 1))

    def forward(self, hidden, inputs, tokens=None, input_ids=None, embedded=None, shared_kv=None):
        per_layer_input = self.per_layer_inputs(input_ids, embedded)[..., 0, :] if self.per_layer_width else None
        hidden, key_value, expert_ids = super().forward(hidden, inputs.cos, inputs.sin, inputs.mask,
                                                        per_layer_input, shared_kv)
        statistics = routing_statistics(None, expert_ids, self.routed(tokens), self.experts_config) if self.sparse \
            else None
        return hidden, statistics, key_value

    def routed(self, tokens):
        """The routed tokens (models/moe.py RoutedTokens) of the stage's that this layer's router sees: all of them
        (tensor parallelism gives each rank its sequence-parallel share: models/tensor_parallel.py gemma4_moe_plan)."""
        return tokens


DECODER_LAYERS = {COMPOSED: DecoderLayer, GEMMA3: Gemma3Decoder, GEMMA4: Gemma4Decoder}


def decoder_layer(config, layer_index=0, attention_impl="sdpa"):
    """Decoder layer layer_index of a model, its family's kind."""
    return DECODER_LAYERS[architecture_of(config).decoder](config, layer_index, attention_impl)


def final_norm(config):
    """The model's final norm, `model.norm`, its family's kind."""
    decoder = architecture_of(config).decoder
    if decoder == COMPOSED:
        architecture = architecture_of(config)
        return RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_fp32=architecture.norm_scale_in_fp32,
                       offset=architecture.offset_norms)
    return {GEMMA3: gemma3_final_norm, GEMMA4: gemma4_final_norm}[decoder](config)
