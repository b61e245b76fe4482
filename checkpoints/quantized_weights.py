"""Block-quantised fp8 weights, as DeepSeek publishes DeepSeek-V3 and R1 (and Kimi K2): each quantised weight is
float8 (e4m3) beside a `<name>_scale_inv` fp32 tensor of one scale per block of weight_block_size (128 x 128) rows
and columns, the edge blocks cut short. Conversion dequantises them (weight x its block's scale, in fp32, cast to
the config's dtype: bf16 for DeepSeek-V3, as DeepSeek's own fp8_cast_bf16.py), because training updates the weights
in that dtype; the converted config.json then drops its quantization_config. Any other quantisation is refused in
one line before a weight is read (check_model_config).
"""
import json
import os

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(config):
    """(rows, columns) of a block-quantised fp8 checkpoint's scale blocks; None for any other config (an other
    quantisation is then refused by models/architecture.py's check_model_config)."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    quantization = quantization if isinstance(quantization, dict) else quantization.to_dict()
    block = quantization.get("weight_block_size")
    if quantization.get("quant_method") != "fp8" or not block or len(block) != 2:
        return None
    return tuple(block)


def scaled_weights(names):
    """{weight name: its scale's name} of the quantised weights among `names` (a scale beside its weight)."""
    return {name.removesuffix(SCALE_SUFFIX): name for name in names
            if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in names}


def dequantized(weight, scale_inv, block, dtype):
    """weight (..., rows, columns), float8, times the scale of its (block rows x block columns) block, in fp32, cast
    to dtype; scale_inv (..., ceil(rows / block rows), ceil(columns / block columns))."""
    rows, columns = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :columns]
    return (weight.float() * scale).to(dtype)


def check_scales(name, weight_shape, scale_shape, block):
    """A ValueError naming a scale whose grid does not cover its weight in blocks of `block`."""
    expected = (*weight_shape[:-2], *(-(-size // edge) for size, edge in zip(weight_shape[-2:], block)))
    if tuple(scale_shape) != expected:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_shape)}, but {name} {tuple(weight_shape)} in "
                         f"blocks of {list(block)} (weight_block_size in config.json) needs {expected}.")


def unscaled_error(name, dtype, path, quantized):
    """The refusal of a float8 tensor the converter cannot dequantise."""
    return (f"{name} ({os.path.basename(path)}) is {dtype} without a {name}{SCALE_SUFFIX} beside it"
            f"{'' if quantized else ' or a quantization_config in config.json'}: the converter cannot dequantise it; "
            f"dequantise the checkpoint to bf16 first.")


def drop_quantization_config(config_path):
    """A converted config.json without the quantization_config its dequantised weights no longer have."""
    with open(config_path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
