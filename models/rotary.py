"""The rotary embedding's tables, as transformers computes them for every rope_type: one set for the whole model
(RotaryEmbedding), or one per layer type (RotaryByLayerType: Gemma 3, Gemma 4, OLMo 3)."""
import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from models.architecture import architecture_of, head_dim_of


class RotaryEmbedding(nn.Module):
    """transformers' LlamaRotaryEmbedding (every rope_type, through its own init functions and dynamic update),
    written here because importing transformers' modeling code would cost every rank memory it never uses."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        init = default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init(config)
        self.in_fp32 = architecture_of(config).rotary_in_fp32
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = torch.float32 if self.in_fp32 else x.dtype  # OLMo 2's tables stay fp32
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def default_rope_parameters(config):
    dim = int(head_dim_of(config) * architecture_of(config).rotary_fraction)
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


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
        # {a layer's window: its type}, the attention inputs' key for the type's tables (each type has its window)
        windows = {layer_type: config.sliding_window if layer_type == "sliding_attention" else None
                   for layer_type in self.frequencies}
        if len(set(windows.values())) < len(windows):
            raise ValueError(f"the layer types {sorted(windows)} attend within the same window "
                             f"(sliding_window={config.sliding_window}); set sliding_window in config.json.")
        self.type_of_window = {window: layer_type for layer_type, window in windows.items()}

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
