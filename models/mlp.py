"""The dense feed-forward of a decoder layer, and the shared experts beside a mixture's routed ones: SwiGLU."""
from torch import nn

from models.architecture import ACTIVATIONS, architecture_of


class MLP(nn.Module):
    """act(gate_proj(x)) * up_proj(x), projected back by down_proj. width: another dense MLP's intermediate
    features (an MoE layer's shared expert); None: intermediate_size."""

    def __init__(self, config, width=None):
        super().__init__()
        bias = architecture_of(config).mlp_bias
        inter = width or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
