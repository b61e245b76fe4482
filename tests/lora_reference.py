"""peft on transformers, the reference LoRA runs are compared with: the same adapters on the Hugging Face model."""
import torch
from transformers import AutoModelForCausalLM

from models.lora import PROJECTIONS, initial_factors

PEFT_PREFIX = "base_model.model."


def hf_name_of_peft(name):
    """base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> model.layers.0.…lora_A.weight"""
    return name.removeprefix(PEFT_PREFIX).replace(".default.", ".")


def adapter_values(config, settings, seed, nonzero_b=False):
    """{HF name of each adapter factor: its whole initial value}: the trainer's (models/lora.py), or with B drawn
    at random too (nonzero_b), so that a single step's gradients reach A."""
    values = {}
    for layer in range(config.num_hidden_layers):
        for position, name in enumerate(PROJECTIONS):
            if name not in settings.target_modules:
                continue
            module = f"model.layers.{layer}.{'self_attn' if position < 4 else 'mlp'}.{name}"
            in_features, out_features = projection_shape(config, name)
            a, b = initial_factors(seed, layer + 1, position, settings.rank, in_features, out_features)
            if nonzero_b:
                b = torch.randn(b.shape, generator=torch.Generator().manual_seed(seed + layer * 10 + position)) * 0.1
            values[f"{module}.lora_A.weight"], values[f"{module}.lora_B.weight"] = a, b
    return values


def projection_shape(config, name):
    """(in, out) features of a projection of the Hugging Face model."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, (config.num_key_value_heads or config.num_attention_heads) * head_dim
    outputs = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": config.hidden_size,
               "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size,
               "down_proj": config.hidden_size}
    inputs = {"o_proj": q, "down_proj": config.intermediate_size}
    return inputs.get(name, config.hidden_size), outputs[name]


def peft_model(hf_dir, settings, values):
    """The Hugging Face model (fp32, eager attention) with peft adapters set to `values` (adapter_values)."""
    from peft import get_peft_model
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    model = get_peft_model(model, settings.peft_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(values[hf_name_of_peft(name)])
    return model


def pipeline_slice(value, param, rank, size):
    """This tensor-parallel rank's slice of a whole adapter value (split like models/lora.py splits it)."""
    dim = getattr(param, "tensor_parallel_dim", None)
    return value if dim is None or size == 1 else value.chunk(size, dim)[rank]

