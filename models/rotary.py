"""The rotary embedding's tables, as transformers computes them for every rope_type."""
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
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def default_rope_parameters(config):
    dim = int(head_dim_of(config) * architecture_of(config).rotary_fraction)
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0
