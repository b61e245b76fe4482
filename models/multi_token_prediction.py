"""Multi-token prediction (MTP), one depth, as DeepSeek-V3 defines it (its paper, section 2.2) and Megatron trains
it: at position i the MTP layer combines the main model's final hidden state h_i (after the final norm, as
Megatron's decoder hands it on) with the shared embedding of the next token t_{i+1}, and predicts t_{i+2} through
the shared LM head:

    x_i  = projection(cat[embedding_norm(embed(t_{i+1})), hidden_norm(h_i)])
    x    = decoder layer(x)                       (a whole layer: attention within the document, its feed-forward)
    loss = sum over i of cross-entropy(head(norm(x_i)), t_{i+2})

The loss is a sum over the positions whose t_{i+2} is labelled and still in the document of t_i (each packed
document's MTP loss is the one it has alone); the caller divides it as it divides the main loss (Megatron's
per-token loss, DeepSeek's 1/T) and scales it (`mtp_loss_scale`, Megatron's mtp_loss_scaling_factor).

transformers never runs these layers (they serve speculative decoding), so checkpoints carry them under their hub
names (models/layout.py CARRIED_FILE_NAME); MultiTokenPredictionLayout says, per family, where those names are and
how the layer is built, so that DeepSeek-V3's (`model.layers.{L}.*`, one decoder layer of its own) and Qwen3.5's
(`mtp.*`, one full-attention layer) are the same part.
"""
import copy
import dataclasses

import torch
from torch import nn

from models.decoder import DecoderLayer
from models.norms import RMSNorm


@dataclasses.dataclass(frozen=True)
class MultiTokenPredictionLayout:
    """Where a checkpoint keeps its MTP layer. prefix: the hub names' common start; parts: {the part's key prefix
    here: the hub's after prefix} (the decoder layer's `layer.` maps to its own hub prefix); shared: {hub name after
    prefix: the main model's name of the tensor it copies} (DeepSeek-V3 stores the shared embedding and head again
    beside its MTP layer: export writes the trained main ones there); layer_config(config) -> (a config, index): the
    decoder layer is built as that config's layer `index`; norm(config) -> a norm module of the family's kind."""
    prefix: str
    parts: tuple  # ((key prefix here, hub key prefix), ...), longest first
    layer_config: object
    norm: object
    shared: tuple = ()  # ((hub key, main model's HF name), ...)

    def hub_name(self, key):
        """The hub name of a key of MultiTokenPrediction's state dict."""
        ours, theirs = next(part for part in self.parts if key.startswith(part[0]))
        return f"{self.prefix}{theirs}{key.removeprefix(ours)}"

    def key_of(self, hub_name):
        """The key of MultiTokenPrediction's state dict holding a hub tensor; None for one it does not hold (another
        layer's, or a shared copy)."""
        if not hub_name.startswith(self.prefix):
            return None
        rest = hub_name.removeprefix(self.prefix)
        if rest in dict(self.shared):
            return None
        matching = [(ours, theirs) for ours, theirs in self.parts if rest.startswith(theirs)]
        ours, theirs = max(matching, key=lambda part: len(part[1]))  # the decoder's empty prefix matches last
        return f"{ours}{rest.removeprefix(theirs)}"


def following_decoder_layer(config):
    """DeepSeek-V3's MTP layer: the decoder layer after the last (layer L, sparse as the family places experts)."""
    extended = copy.deepcopy(config)
    extended.num_hidden_layers = config.num_hidden_layers + 1
    return extended, config.num_hidden_layers


def full_attention_layer(config):
    """Qwen3.5's MTP layer: one full-attention decoder layer (its feed-forward the model's: experts in the MoE)."""
    extended = copy.deepcopy(config)
    extended.num_hidden_layers = config.num_hidden_layers + 1
    extended.layer_types = [*config.layer_types[:config.num_hidden_layers], "full_attention"]
    return extended, config.num_hidden_layers


def plain_norm(config):
    return RMSNorm(config.hidden_size, config.rms_norm_eps)


def offset_norm(config):
    """The hybrids' (1 + w) RMSNorm."""
    return RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)


def deepseek_layout(config):
    return MultiTokenPredictionLayout(
        prefix=f"model.layers.{config.num_hidden_layers}.",
        parts=(("embedding_norm.", "enorm."), ("hidden_norm.", "hnorm."), ("projection.", "eh_proj."),
               ("norm.", "shared_head.norm."), ("layer.", "")),
        layer_config=following_decoder_layer, norm=plain_norm,
        shared=(("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", "lm_head.weight")))


def qwen3_5_layout(config):
    return MultiTokenPredictionLayout(
        prefix="mtp.", parts=(("embedding_norm.", "pre_fc_norm_embedding."), ("hidden_norm.", "pre_fc_norm_hidden."),
                              ("projection.", "fc."), ("norm.", "norm."), ("layer.", "layers.0.")),
        layer_config=full_attention_layer, norm=offset_norm)


# {model_type: its MTP layer's layout}; the config's count of MTP layers says whether a checkpoint has one.
MTP_LAYOUTS = {"deepseek_v3": deepseek_layout, "glm4_moe": deepseek_layout, "qwen3_5_text": qwen3_5_layout,
               "qwen3_5_moe_text": qwen3_5_layout}


def mtp_layers_of(config):
    """How many MTP layers a config declares (DeepSeek-V3: num_nextn_predict_layers; Qwen3.5: mtp_num_hidden_layers)."""
    return getattr(config, "num_nextn_predict_layers", 0) or getattr(config, "mtp_num_hidden_layers", 0) or 0


def mtp_layout_of(config):
    """The MultiTokenPredictionLayout of a config's one MTP layer; a one-line error where it has none or the
    pipeline does not know its family's."""
    if config.model_type not in MTP_LAYOUTS:
        raise ValueError(f"mtp_loss_scale > 0: model_type '{config.model_type}' has no multi-token-prediction layer "
                         f"the pipeline trains (those of {', '.join(MTP_LAYOUTS)}); set mtp_loss_scale=0.")
    if mtp_layers_of(config) != 1:
        raise ValueError(f"mtp_loss_scale > 0: the {config.model_type} config declares {mtp_layers_of(config)} "
                         f"multi-token-prediction layers; the pipeline trains exactly one (DeepSeek-V3's and "
                         f"Qwen3.5's depth); set mtp_loss_scale=0.")
    return MTP_LAYOUTS[config.model_type](config)


class MultiTokenPrediction(nn.Module):
    """One MTP depth (the module docstring's x): the two input norms, the projection of their concatenation
    ([embedding | hidden], DeepSeek-V3's and Megatron's order), a decoder layer and the norm before the shared
    head."""

    def __init__(self, config, attention_impl="sdpa"):
        super().__init__()
        self.model_config = config  # whose checkpoint names its tensors (checkpoints/mtp_tensors.py)
        layout = mtp_layout_of(config)
        layer_config, layer_index = layout.layer_config(config)
        self.embedding_norm, self.hidden_norm = layout.norm(config), layout.norm(config)
        self.projection = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(layer_config, layer_index, attention_impl)
        self.norm = layout.norm(config)

    def forward(self, hidden, next_embedded, inputs, tokens=None):
        """The normed MTP hidden states at each position. hidden: the main model's final (normed) hidden states;
        next_embedded: the shared embedding of each position's next token; inputs: the batch's AttentionInputs;
        tokens: its RoutedTokens, for a sparse layer's router. The layer's routing statistics go nowhere: its
        router's balancing (DeepSeek-V3's bias update, sequence-wise loss) is not applied."""
        x = self.projection(torch.cat([self.embedding_norm(next_embedded), self.hidden_norm(hidden)], dim=-1))
        x, _ = self.layer(x, inputs, tokens)
        return self.norm(x)


def next_tokens(input_ids):
    """Each position's next token id (the last position's own: nothing learns from it, models/loss.py mtp_labels
    masks it)."""
    return torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)

