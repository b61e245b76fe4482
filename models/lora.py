"""LoRA adapters (Hu et al., 2021) on the decoder layers' projections, in peft's layout, applied to a built stage.

A targeted projection `p` (q_proj ... down_proj) gains two bias-free linear children, `p.lora_A` (rank x in) and
`p.lora_B` (out x rank), and a forward hook that adds scaling * B(A(dropout(x))) to its output, scaling = alpha /
rank: peft's LoraLayer, so a layer's adapter keys (`self_attn.q_proj.lora_A.weight`) are peft's after the
`model.layers.{i}.` prefix. Everything else of the model is frozen: no gradient, no optimizer state, nothing reduced.

Under tensor parallelism an adapter splits like its projection, so no activation of the base width is gathered: on
a column-parallel projection A is whole and B holds this rank's output rows; on a row-parallel one A holds this
rank's input columns and B is whole, its output a partial sum added over the group with the projection's; on one
every rank holds whole (MLA's latent projections) both are whole (models/tensor_parallel.py parallelize_adapters).
Initial values (peft's: A Kaiming-uniform, B zero) are drawn for the whole tensor from a generator seeded by (seed,
layer, target), then sliced: every layout starts from the same adapters.

A mixture of experts' fused experts (`mlp.experts.gate_up_proj` [E, ...], `mlp.experts.down_proj`) take adapters as
peft 0.21 puts them on a parameter (`target_parameters`, its ParamWrapper): per expert e, A_e (rank x in) and B_e
(out x rank), the weight used being W_e + scaling * B_e A_e (one baddbmm over the experts, peft's), held on the
experts as `lora_A.<projection>` [E, rank, in] and `lora_B.<projection>` [E, out, rank] (sliced by expert as the
weights are) and written in peft's layout on export (peft_adapters). Which names reach them is peft's reading of
lora.target_modules on the family (expert_ranks): see docs/lora.md.
"""
import contextlib
import dataclasses
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from models.architecture import GEMMA4, architecture_of, fused_projections
from models.moe import Experts, MoEBlock
from models.pipeline_layers import decoder_kinds_of, decoder_on_meta
from models.tensor_parallel import mark_sharded, shard_of

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS  # lora.target_modules' default
LATENT_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # multi-head latent attention's
# Gated DeltaNet's (Qwen3.5's; Qwen3-Next's fused in_proj_qkvz and in_proj_ba), peft's names
LINEAR_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # a mixture of experts' fused experts, in their module's order
EXPERT_TARGETS = tuple(f"experts.{name}" for name in EXPERT_PARAMETERS)  # peft's target_parameters
TARGETS = PROJECTIONS + LATENT_PROJECTIONS + LINEAR_PROJECTIONS + EXPERT_TARGETS
ADAPTER_FACTORS = ("lora_A", "lora_B")
# The families whose gate_proj, up_proj and down_proj peft 0.21 reads as their fused experts' (its
# transformers_weight_conversion: _MODEL_TO_CONVERSION_PATTERN to qwen2_moe's mapping): gate_proj and up_proj
# together as experts.gate_up_proj at twice the rank and alpha, down_proj as experts.down_proj; their dense MLPs and
# shared experts then take none. (Mixtral's mapping reads w1, w2, w3; Qwen2-MoE and GPT-OSS have none.)
PEFT_EXPERT_MLP_NAMES = ("qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe")


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
        unknown = [name for name in targets if name not in TARGETS]
        if unknown or not targets:
            raise ValueError(f"lora.target_modules {list(targets)}: {unknown or 'none given'} matches no layer; the "
                             f"layers that take adapters are {', '.join(TARGETS)}.")
        return cls(rank, float(alpha) if alpha is not None else None, float(dropout),
                   tuple(name for name in TARGETS if name in targets))

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
        Phi-3's fused projections targeted by their own names, the experts' fused tensors as target_parameters."""
        from peft import LoraConfig
        modules = [name for name in self.target_modules if name not in EXPERT_TARGETS]
        parameters = [name for name in self.target_modules if name in EXPERT_TARGETS]
        return LoraConfig(r=self.rank, lora_alpha=self.lora_alpha, lora_dropout=self.dropout,
                          target_modules=peft_target_modules(config, modules), target_parameters=parameters or None,
                          bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path)


NO_LORA = LoraSettings()


def projections_of(decoder_layer, config):
    """{name: nn.Linear} of the projections of a decoder layer that lora.target_modules can name: its attention's,
    and its MLP's (a sparse layer's: its shared expert's) but where peft reads those names as the experts'."""
    mlp = decoder_layer.mlp
    if isinstance(mlp, MoEBlock):
        mlp = getattr(mlp, mlp.moe.shared_expert_name, None)
    if config.model_type in PEFT_EXPERT_MLP_NAMES:
        mlp = None
    found = {name: getattr(decoder_layer.token_mixer, name, None)
             for name in ATTENTION_PROJECTIONS + LATENT_PROJECTIONS + LINEAR_PROJECTIONS}
    found.update({name: getattr(mlp, name, None) for name in MLP_PROJECTIONS})
    return {name: module for name, module in found.items() if isinstance(module, nn.Linear)}


def expert_ranks(config, target_modules, rank):
    """{fused expert tensor (gate_up_proj, down_proj): its adapters' rank} as peft 0.21 targets them on a model of
    `config` from target_modules: experts.gate_up_proj / experts.down_proj (target_parameters) at the rank; on the
    families in PEFT_EXPERT_MLP_NAMES also gate_proj with up_proj at twice the rank and down_proj at the rank."""
    if architecture_of(config).moe is None:
        return {}
    ranks = {name: rank for name in EXPERT_PARAMETERS if f"experts.{name}" in target_modules}
    if config.model_type in PEFT_EXPERT_MLP_NAMES:
        if "gate_proj" in target_modules:
            ranks["gate_up_proj"] = 2 * rank
        if "down_proj" in target_modules:
            ranks["down_proj"] = rank
    return ranks


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
    """Targets a peft adapter on this model can hold, before any work. Names the model lacks are left out, as peft
    leaves them, but some must reach something. peft adapts Phi-3's fused qkv_proj and gate_up_proj as single
    projections (one A over q, k and v), so the pipeline's parts of one take adapters together; on a mixture of
    experts peft's reading of the MLP names must be whole (gate_proj with up_proj) and single (not beside
    experts.*), and peft's adapters on the experts take no dropout."""
    targets = settings.target_modules
    for fused, parts in fused_target_groups(config).items():
        targeted = [name for name in parts if name in targets]
        if targeted and len(targeted) != len(parts):
            raise ValueError(f"lora.target_modules {list(targets)}: a {config.model_type} model fuses "
                             f"{', '.join(parts)} into {fused}, which takes one adapter; target all of them or none.")
    reached = model_targets(config)
    if not any(name in reached for name in targets):
        raise ValueError(f"lora.target_modules {list(targets)} matches nothing of this {config.model_type} model; "
                         f"it takes adapters on {', '.join(reached)}.")
    experts = expert_ranks(config, targets, settings.rank)
    if experts and architecture_of(config).decoder == GEMMA4:
        raise ValueError(f"lora.target_modules {list(targets)}: Gemma 4's experts ({', '.join(experts)}) take no "
                         f"adapters yet; leave experts.* out (its attention and dense MLP projections take them).")
    mlp_names = [name for name in MLP_PROJECTIONS if name in targets]
    if config.model_type in PEFT_EXPERT_MLP_NAMES and mlp_names:
        if ("gate_proj" in targets) != ("up_proj" in targets):
            raise ValueError(f"lora.target_modules {list(targets)}: peft 0.21 reads gate_proj and up_proj of a "
                             f"{config.model_type} model as its experts' fused gate_up_proj, which takes one adapter; "
                             f"target both or neither.")
        explicit = [name for name in EXPERT_TARGETS if name in targets]
        if explicit:
            raise ValueError(f"lora.target_modules {list(targets)}: peft 0.21 reads {', '.join(mlp_names)} of a "
                             f"{config.model_type} model as its experts already (gate_up_proj at twice the rank); "
                             f"name the experts either way, not both ({', '.join(explicit)} or "
                             f"{', '.join(mlp_names)}).")
    if experts and settings.dropout:
        raise ValueError(f"lora.dropout={settings.dropout} with adapters on the experts of a {config.model_type} model "
                         f"({', '.join(f'experts.{name}' for name in experts)}): peft's adapters on a parameter take "
                         f"no dropout (its ParamWrapper refuses it); set lora.dropout=0.0.")


def model_targets(config):
    """The lora.target_modules names that reach something of a model: its projections', its experts' (by their
    own names, and by the MLP names where peft reads those as the experts')."""
    names = {name for layer in decoder_kinds_on_meta(config) for name in projections_of(layer, config)}
    if architecture_of(config).moe is not None:
        names.update(EXPERT_TARGETS + (MLP_PROJECTIONS if config.model_type in PEFT_EXPERT_MLP_NAMES else ()))
    return [name for name in TARGETS if name in names]


def check_rank_fits(config, settings):
    """A rank at least as wide as a targeted projection's smaller side adds nothing a full update would not."""
    experts = expert_ranks(config, settings.target_modules, settings.rank)
    too_narrow = {}
    for layer in decoder_kinds_on_meta(config):
        ranks = {name: (settings.rank, min(projection.in_features, projection.out_features))
                 for name, projection in projections_of(layer, config).items() if name in settings.target_modules}
        if getattr(layer.mlp, "experts", None) is not None:
            ranks.update({f"experts.{name}": (rank, min(expert_features(layer.mlp.experts, name)))
                          for name, rank in experts.items()})
        too_narrow.update({name: side for name, (rank, side) in ranks.items() if rank >= side})
    if too_narrow:
        raise ValueError(f"lora.rank={settings.rank} does not fit "
                         f"{', '.join(f'{name} (smallest side {side})' for name, side in too_narrow.items())}: a "
                         f"rank must be below a projection's smaller side; lower lora.rank.")


def decoder_kinds_on_meta(config):
    """One decoder layer of each kind the model has (its token mixer, dense or sparse) on the meta device."""
    kinds = decoder_kinds_of(config)
    return [decoder_on_meta(config, layer_index=kinds.index(kind)) for kind in sorted(set(kinds))]


def adapter_parameter_count(config, settings, tensor_parallel=1, layer_index=None, active=False):
    """Adapter parameters of one decoder layer (decoder_on_meta's) on one tensor-parallel rank, from the config;
    active: the experts' as a token runs through them (top_k of the experts), as MFU counts the experts."""
    if not settings.enabled:
        return 0
    layer = decoder_on_meta(config, tensor_parallel, layer_index)
    add_adapters(layer, settings, config, tensor_parallel)
    moe = architecture_of(config).moe
    share = moe.top_k / moe.num_experts if active and moe else 1
    return round(sum(p.numel() * (share if ".experts." in f".{name}" else 1)
                     for name, p in layer.named_parameters() if is_adapter_key(name)))


def adapter_parameter_total(config, settings, active=False):
    """Adapter parameters of every decoder layer (dense and sparse ones may differ); active: as MFU counts them
    (adapter_parameter_count)."""
    sparse = architecture_of(config).sparse_layers
    return sum(sparse.count(kind) * adapter_parameter_count(config, settings, layer_index=sparse.index(kind),
                                                            active=active) for kind in set(sparse))


def add_adapters(decoder_layer, settings, config, tensor_parallel_size=1, tensor_parallel_rank=0, seed=None,
                 index=0):
    """Give a decoder layer's targeted projections adapters (this rank's slices), and its experts theirs. seed: draw
    peft's initial values for pipeline layer `index` (None on the meta device, where shapes are all that is
    wanted)."""
    for name, projection in projections_of(decoder_layer, config).items():
        if name not in settings.target_modules:
            continue
        dim = getattr(projection.weight, "tensor_parallel_dim", None)  # 0: column-parallel, 1: row-parallel
        whole_in, whole_out = whole_features(projection, tensor_parallel_size)
        device, dtype = projection.weight.device, projection.weight.dtype
        projection.lora_A = nn.Linear(projection.in_features if dim == 1 else whole_in, settings.rank, bias=False,
                                      device=device, dtype=dtype)
        projection.lora_B = nn.Linear(settings.rank, projection.out_features if dim == 0 else whole_out, bias=False,
                                      device=device, dtype=dtype)
        projection.lora_scaling, projection.lora_dropout = settings.scaling, settings.dropout
        split = {1: projection.lora_A.weight, 0: projection.lora_B.weight}.get(dim)
        if tensor_parallel_size > 1 and split is not None:
            mark_sharded(split, dim)
        # B of a projection cut per block (in_proj_qkv's q, k and v) holds the rows its outputs do: marked whatever
        # the split, as its projection is, so that a checkpoint saved split loads whole
        blocks = getattr(projection.weight, "tensor_parallel_blocks", None)
        if blocks is not None:
            projection.lora_B.weight.tensor_parallel_blocks = blocks
        if seed is not None:
            a, b = initial_factors(seed, index, TARGETS.index(name), settings.rank, whole_in, whole_out)
            with torch.no_grad():
                projection.lora_A.weight.copy_(shard_of(a, 1, tensor_parallel_rank, tensor_parallel_size)
                                               if dim == 1 else a)
                projection.lora_B.weight.copy_(shard_of(b, 0, tensor_parallel_rank, tensor_parallel_size, blocks)
                                               if dim == 0 else b)
        projection.register_forward_hook(add_adapter_output)
    share_fused_adapters(decoder_layer, config)
    experts = getattr(decoder_layer.mlp, "experts", None)
    if experts is not None:
        add_expert_adapters(experts, expert_ranks(config, settings.target_modules, settings.rank), settings, seed,
                            index)


def add_adapter_output(projection, args, out):
    """A projection's output with its adapter's added: out + scaling * B(A(dropout(x)))."""
    x = F.dropout(args[0], projection.lora_dropout, projection.training)
    return out + projection.lora_B(projection.lora_A(x)) * projection.lora_scaling


class AdaptedExperts(Experts):
    """A mixture's experts with adapters on their fused projections: each expert's weight is W_e + scaling B_e A_e,
    one baddbmm over the experts, as peft's ParamWrapper folds it (A [E, rank, in], B [E, out, rank])."""

    def weight(self, name):
        weight = getattr(self, name)
        if name not in self.lora_A or not self.lora_scaling:
            return weight
        a, b = self.lora_A[name], self.lora_B[name]
        if self.transposed:  # [E, in, out]
            return torch.baddbmm(weight, a.transpose(-2, -1), b.transpose(-2, -1), alpha=self.lora_scaling)
        return torch.baddbmm(weight, b, a, alpha=self.lora_scaling)


def expert_features(experts, name):
    """(in, out) features of each expert's projection `name` (gate_up_proj: hidden -> 2 x inner)."""
    weight = getattr(experts, name)
    return tuple(weight.shape[1:]) if experts.transposed else tuple(weight.shape[:0:-1])


def add_expert_adapters(experts, ranks, settings, seed=None, index=0):
    """peft's adapters on fused expert tensors ({name: rank}): A [E, rank, in] and B [E, out, rank] on `experts`
    (its lora_A / lora_B), the scaling alpha / lora.rank (twice the rank takes twice the alpha). The initial A is
    drawn for all of the layer's experts, as peft draws its [E x rank, in] (row e x rank + j: expert e's j-th), so
    that an expert-parallel rank's slice is the same."""
    if not ranks:
        return
    weight = experts.gate_up_proj
    experts.__class__ = AdaptedExperts  # the same module and parameters, its weights folded with the adapters
    experts.lora_A, experts.lora_B = nn.ParameterDict(), nn.ParameterDict()
    experts.lora_scaling = settings.scaling
    for name, rank in ranks.items():
        in_features, out_features = expert_features(experts, name)
        count = experts.num_local_experts
        a = torch.empty(count * rank, in_features, device=weight.device, dtype=weight.dtype)
        b = torch.zeros(count, out_features, rank, device=weight.device, dtype=weight.dtype)
        if seed is not None:
            whole, _ = initial_factors(seed, index, TARGETS.index(f"experts.{name}"), experts.first_expert * rank +
                                       count * rank, in_features, 0)
            a.copy_(whole[experts.first_expert * rank:])
        experts.lora_A[name] = nn.Parameter(a.view(count, rank, in_features))
        experts.lora_B[name] = nn.Parameter(b)


def share_fused_adapters(decoder_layer, config):
    """The parts of one of Phi-3's fused projections share its first part's A (column-parallel: whole on every
    rank), as peft's one adapter on the fused projection has; each keeps its rows of B."""
    projections = projections_of(decoder_layer, config)
    for first, *others in fused_target_groups(config).values():
        for name in others:
            if hasattr(projections[name], "lora_A"):
                projections[name].lora_A = projections[first].lora_A


def initial_factors(seed, index, position, rank, in_features, out_features):
    """peft's initial A (Kaiming-uniform, a=sqrt(5)) and B (zeros) of the whole adapter on pipeline layer `index`'s
    target number `position` (TARGETS order), the same for every layout."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index * len(TARGETS) + position)
    a = torch.empty(rank, in_features)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a, torch.zeros(out_features, rank)


def peft_adapters(adapters):
    """{peft's name (after base_model.model.): tensor} of adapters {the pipeline's HF name: tensor}. An expert
    adapter as peft's ParamWrapper holds it: A [E x rank, in] (row e x rank + j: expert e's j-th), B [out, rank x E]
    (column j x E + e), on the experts module nested once for each of its tensors targeted after it
    (`mlp.experts.base_layer.lora_A.weight` is gate_up_proj's when down_proj is targeted too, as peft wraps the
    module's parameters in their order). Every other adapter's name is peft's already."""
    targeted = {}
    for name in adapters:
        match = EXPERT_ADAPTER.match(name)
        if match:
            targeted.setdefault(match.group(1), set()).add(match.group(3))
    renamed = {}
    for name, tensor in adapters.items():
        match = EXPERT_ADAPTER.match(name)
        if match is None:
            renamed[name] = tensor
            continue
        module, factor, param = match.groups()
        later = [p for p in EXPERT_PARAMETERS[EXPERT_PARAMETERS.index(param) + 1:] if p in targeted[module]]
        renamed[f"{module}.{'base_layer.' * len(later)}{factor}.weight"] = \
            tensor.flatten(0, 1) if factor == "lora_A" else tensor.permute(1, 2, 0).flatten(1)
    return renamed


EXPERT_ADAPTER = re.compile(rf"^(model\.layers\.\d+\.mlp\.experts)\.(lora_[AB])\.({'|'.join(EXPERT_PARAMETERS)})$")


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
