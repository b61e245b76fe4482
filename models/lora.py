"""LoRA adapters (Hu et al., 2021) on the decoder layers' projections, in peft's layout, applied to a built stage.

A targeted projection `p` (q_proj ... down_proj) gains two bias-free linear children, `p.lora_A` (rank x in) and
`p.lora_B` (out x rank), and computes y = p(x) + scaling * B(A(dropout(x))) with scaling = alpha / rank: peft's
LoraLayer, so a layer's adapter keys (`self_attn.q_proj.lora_A.weight`) are peft's after the `model.layers.{i}.`
prefix. Everything else of the model is frozen: no gradient, no optimizer state, nothing reduced.

Under tensor parallelism an adapter splits like its projection, so no activation of the base width is gathered: on
a column-parallel projection A is whole and B holds this rank's output rows; on a row-parallel one A holds this
rank's input columns and B is whole (models/tensor_parallel.py runs them). Initial values (peft's: A
Kaiming-uniform, B zero) are drawn for the whole tensor from a generator seeded by (seed, layer, projection), then
sliced: every layout starts from the same adapters.
"""
import contextlib
import dataclasses
import math

import torch
from torch import nn

from models.llama import DecoderLayerPipe, fused_projections
from models.tensor_parallel import SHARDED_MARKER, TensorParallel

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input feature; the others by output feature
ADAPTER_FACTORS = ("lora_A", "lora_B")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """The `lora:` config node. rank 0: no adapters (full fine-tuning)."""
    rank: int = 0
    alpha: float | None = None  # None: 2 x rank (LLaMA-Factory's default)
    dropout: float = 0.0
    target_modules: tuple = PROJECTIONS

    @classmethod
    def from_cfg(cls, node):
        """The settings of a `lora:` node, or ValueError naming the bad value."""
        rank, alpha, dropout = node.rank, node.alpha, node.dropout
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"lora.rank={rank!r} must be an integer >= 0 (0: full fine-tuning).")
        if alpha is not None and not (isinstance(alpha, (int, float)) and alpha > 0):
            raise ValueError(f"lora.alpha={alpha!r} must be a positive number, or null for 2 x lora.rank.")
        if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
            raise ValueError(f"lora.dropout={dropout!r} must be in [0, 1).")
        targets = node.target_modules
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
        unknown = [name for name in targets if name not in PROJECTIONS]
        if unknown or not targets:
            raise ValueError(f"lora.target_modules {list(targets)}: {unknown or 'none given'} matches no layer; the "
                             f"layers that take adapters are {', '.join(PROJECTIONS)}.")
        return cls(rank, float(alpha) if alpha is not None else None, float(dropout),
                   tuple(name for name in PROJECTIONS if name in targets))

    @property
    def enabled(self):
        return self.rank > 0

    @property
    def lora_alpha(self):
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @property
    def scaling(self):
        return self.lora_alpha / self.rank

    def as_dict(self):
        return {"rank": self.rank, "alpha": self.lora_alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules)}

    def peft_config(self, config, base_model_name_or_path=None):
        """peft's LoraConfig of these adapters on a model of `config` (the adapter_config.json an export writes):
        Phi-3's fused projections targeted by their own names."""
        from peft import LoraConfig
        return LoraConfig(r=self.rank, lora_alpha=self.lora_alpha, lora_dropout=self.dropout,
                          target_modules=peft_target_modules(config, self.target_modules), bias="none",
                          task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path)


NO_LORA = LoraSettings()


def projections_of(decoder_layer):
    """{name: nn.Linear} of a decoder layer's projections."""
    return {name: getattr(decoder_layer.self_attn if name in ATTENTION_PROJECTIONS else decoder_layer.mlp, name)
            for name in PROJECTIONS}


def whole_features(projection, size):
    """(in, out) features of a projection before tensor parallelism split it over `size` ranks."""
    dim = getattr(projection.weight, "tensor_parallel_dim", None)
    return (projection.in_features * (size if dim == 1 else 1), projection.out_features * (size if dim == 0 else 1))


def fused_target_groups(config):
    """{Phi-3's fused projection: its parts}, by their names in lora.target_modules."""
    return {fused.rsplit(".", 1)[-1]: tuple(part.rsplit(".", 1)[-1] for part, _ in parts)
            for fused, parts in fused_projections(config).items()}


def peft_target_modules(config, target_modules):
    """peft's target_modules of adapters on target_modules: a fused projection in place of its parts."""
    groups = fused_target_groups(config)
    fused = [name for name, parts in groups.items() if parts[0] in target_modules]
    return fused + [name for name in target_modules if not any(name in parts for parts in groups.values())]


def check_lora_applies(config, settings):
    """peft adapts Phi-3's fused qkv_proj and gate_up_proj as single projections (one A over q, k and v): the
    pipeline's parts of one take adapters together."""
    for fused, parts in fused_target_groups(config).items():
        targeted = [name for name in parts if name in settings.target_modules]
        if targeted and len(targeted) != len(parts):
            raise ValueError(f"lora.target_modules {list(settings.target_modules)}: a {config.model_type} model fuses "
                             f"{', '.join(parts)} into {fused}, which takes one adapter; target all of them or none.")


def check_rank_fits(config, settings):
    """A rank at least as wide as a targeted projection's smaller side adds nothing a full update would not."""
    too_narrow = {name: min(projection.in_features, projection.out_features)
                  for name, projection in projections_of(decoder_on_meta(config)).items()
                  if name in settings.target_modules and settings.rank >= min(projection.in_features,
                                                                             projection.out_features)}
    if too_narrow:
        raise ValueError(f"lora.rank={settings.rank} does not fit "
                         f"{', '.join(f'{name} (smallest side {side})' for name, side in too_narrow.items())}: a "
                         f"rank must be below a projection's smaller side; lower lora.rank.")


def decoder_on_meta(config, tensor_parallel=1):
    """One decoder layer on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return DecoderLayerPipe(config, stage_inputs=None, parallel=TensorParallel(tensor_parallel))


def adapter_parameter_count(config, settings, tensor_parallel=1):
    """Adapter parameters of one decoder layer on one tensor-parallel rank, from the config alone."""
    if not settings.enabled:
        return 0
    layer = decoder_on_meta(config, tensor_parallel)
    add_adapters(layer, settings, tensor_parallel)
    return sum(p.numel() for p in adapter_parameters(layer))


def add_adapters(decoder_layer, settings, tensor_parallel_size=1, tensor_parallel_rank=0, seed=None, index=0):
    """Give a decoder layer's targeted projections adapters (this rank's slices). seed: draw peft's initial values
    for pipeline layer `index` (None on the meta device, where shapes are all that is wanted)."""
    for position, (name, projection) in enumerate(projections_of(decoder_layer).items()):
        if name not in settings.target_modules:
            continue
        row = name in ROW_PARALLEL
        whole_in, whole_out = whole_features(projection, tensor_parallel_size)
        device, dtype = projection.weight.device, projection.weight.dtype
        projection.lora_A = nn.Linear(projection.in_features if row else whole_in, settings.rank, bias=False,
                                      device=device, dtype=dtype)
        projection.lora_B = nn.Linear(settings.rank, whole_out if row else projection.out_features, bias=False,
                                      device=device, dtype=dtype)
        projection.lora_scaling, projection.lora_dropout = settings.scaling, settings.dropout
        if tensor_parallel_size > 1:  # DeepSpeed's marker: see TensorParallel.mark_sharded
            split = projection.lora_A.weight if row else projection.lora_B.weight
            split.tensor_parallel_dim = 1 if row else 0
            setattr(split, SHARDED_MARKER, True)
        if seed is not None:
            a, b = initial_factors(seed, index, position, settings.rank, whole_in, whole_out)
            with torch.no_grad():
                projection.lora_A.weight.copy_(a.chunk(tensor_parallel_size, 1)[tensor_parallel_rank] if row else a)
                projection.lora_B.weight.copy_(b if row else b.chunk(tensor_parallel_size, 0)[tensor_parallel_rank])
    share_fused_adapters(decoder_layer)


def share_fused_adapters(decoder_layer):
    """The parts of one of Phi-3's fused projections share its first part's A (column-parallel: whole on every
    rank), as peft's one adapter on the fused projection has; each keeps its rows of B."""
    projections = projections_of(decoder_layer)
    for first, *others in decoder_layer.fused_groups:
        for name in others:
            if hasattr(projections[name], "lora_A"):
                projections[name].lora_A = projections[first].lora_A


def initial_factors(seed, index, position, rank, in_features, out_features):
    """peft's initial A (Kaiming-uniform, a=sqrt(5)) and B (zeros) of the whole adapter on pipeline layer `index`'s
    projection number `position` (PROJECTIONS order), the same for every layout."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index * len(PROJECTIONS) + position)
    a = torch.empty(rank, in_features)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a, torch.zeros(out_features, rank)


def adapter_layer_indices(num_hidden_layers):
    """Pipeline layers that hold adapters (and, in a LoRA checkpoint, optimizer state): the decoder layers."""
    return range(1, num_hidden_layers + 1)


def is_adapter_key(key):
    """Whether a layer's state-dict key (or parameter name) belongs to an adapter."""
    return any(f".{factor}." in f".{key}" for factor in ADAPTER_FACTORS)


def adapter_parameters(module):
    return [p for name, p in module.named_parameters() if is_adapter_key(name)]


def freeze_all_but_adapters(module):
    """LoRA training: only the adapters take gradients."""
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter_key(name))


@contextlib.contextmanager
def adapters_off(module):
    """The base model's outputs while inside (peft's disable_adapter): every adapter's scaling 0, so each adapted
    projection adds exact zeros; the DPO reference under LoRA, with no second copy of the weights."""
    adapted = [m for m in module.modules() if hasattr(m, "lora_scaling")]
    scalings = [m.lora_scaling for m in adapted]
    for m in adapted:
        m.lora_scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(adapted, scalings):
            m.lora_scaling = scaling
