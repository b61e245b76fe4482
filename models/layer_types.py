"""What a decoder layer's attention takes from its layer type, for the families whose config lists `layer_types`
('sliding_attention' or 'full_attention' per layer) with rotary parameters per type (Gemma 3, Gemma 4, OLMo 3): the
rotary tables of each type and the masks of each type's window.

The tables and masks are built once per micro-batch for every type a stage holds, not once per layer, and handed to
each layer with its type's; a layer never builds its own.
"""
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.attention_kernels import additive_mask
from models.attention import document_causal_mask, within_window

# Rotary types whose frequencies transformers recomputes from the sequence length at every call: tables built once
# at construction cannot follow them.
LENGTH_DEPENDENT_ROTARY = ("dynamic", "longrope")


def default_frequencies(config, layer_type):
    """transformers' compute_default_rope_parameters of the Gemma 3, Gemma 4 and OLMo 3 rotary embeddings: the
    standard inverse frequencies over the layer type's whole head_dim."""
    base = config.rope_parameters[layer_type]["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class RotaryByLayerType:
    """cos and sin of each layer type, from `config.rope_parameters[type]` through transformers' own init functions
    (linear scaling, YaRN, Gemma 4's proportional partial rotary: frequencies over the full head_dim, the ones past
    the rotary fraction zero). Each type is resolved against its own per-layer config (Gemma 4's full layers have
    their own head_dim), as Gemma4TextRotaryEmbedding does; for Gemma 3 and OLMo 3 that is the config itself.

    A plain object, not a module: it adds no buffers to the layers, and it can be built where modules are built on
    the meta device (the frequencies are computed on the CPU, and copied to a device once, when first used there)."""

    def __init__(self, config, layer_types=None):
        self.frequencies, self.scaling, self._on_device = {}, {}, {}
        with torch.device("cpu"):
            for layer_type in sorted(set(layer_types or config.layer_types)):
                rope_type = config.rope_parameters[layer_type]["rope_type"]
                if rope_type in LENGTH_DEPENDENT_ROTARY:
                    raise ValueError(f"rope_parameters['{layer_type}'] rope_type '{rope_type}' changes its frequencies "
                                     f"with the sequence length, which is not implemented for per-type rotary "
                                     f"tables; use 'default', 'linear', 'yarn', 'llama3' or 'proportional'.")
                layer_config = config.per_layer_config[layer_type]
                if rope_type == "default":
                    inv_freq, scaling = default_frequencies(layer_config, layer_type)
                else:
                    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](layer_config, layer_type=layer_type)
                self.frequencies[layer_type], self.scaling[layer_type] = inv_freq.float(), scaling

    def inverse_frequencies(self, layer_type, device):
        key = (layer_type, device)
        if key not in self._on_device:
            self._on_device[key] = self.frequencies[layer_type].to(device)
        return self._on_device[key]

    @torch.no_grad()
    def __call__(self, position_ids, dtype):
        """{layer type: (cos, sin)}, each (batch, seq, rotary features) in `dtype`: Gemma's tables are cast to the
        hidden states' dtype; OLMo 3 keeps them in fp32 (its rotation runs in fp32, then casts back)."""
        tables = {}
        for layer_type in self.frequencies:
            inv_freq = self.inverse_frequencies(layer_type, position_ids.device)
            freqs = position_ids[..., None].float() * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            scaling = self.scaling[layer_type]
            tables[layer_type] = ((emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype))
        return tables


def layer_windows(config):
    """{layer type: its attention window (keys > query - window), None for the whole sequence}."""
    return {layer_type: config.sliding_window if layer_type == "sliding_attention" else None
            for layer_type in set(config.layer_types)}


def masks_by_layer_type(document_ids, windows, dtype, packed=True):
    """{layer type: the additive mask of its window, or None for plain causal attention}.

    document_ids (batch, seq): 0 on padding, k >= 1 on a row's k-th document. packed: the rows may hold several
    documents, so each type takes the document mask; else (one document then padding, as transformers' padded
    rows) the full layers attend causally with no mask, which computes every real token as the padding mask would,
    and a window shorter than the row takes its band."""
    allowed = document_causal_mask(document_ids) if packed else None
    return {layer_type: additive_mask(within_window(allowed, window, document_ids), dtype)
            for layer_type, window in windows.items()}
