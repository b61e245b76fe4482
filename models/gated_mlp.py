"""The gated MLP of one decoder layer on one device, `down(act(gate(x)) * up(x))`, under transformers' names: Gemma
3's and Gemma 4's GeGLU (gelu_pytorch_tanh), OLMo 3's SwiGLU (silu)."""
from torch import nn

from models.architecture import ACTIVATIONS


class GatedMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, activation):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"hidden activation '{activation}' is not supported; supported: {', '.join(ACTIVATIONS)}.")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACTIVATIONS[activation]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
