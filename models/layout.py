"""The layer index map: which pipeline layer owns which Hugging Face weight. Both conversion directions and
post-init loading go through here, so the map exists once.

| index    | layer            | HF weight names                                       |
| 0        | embedding        | model.embed_tokens.weight                             |
| 1 .. L   | decoder layer i-1| model.layers.{i-1}.*  (prefix stripped); Gemma 4: its |
|          |                  | share of the per-layer embeddings (PER_LAYER_TENSORS) |
| L+1      | final norm       | model.norm.weight                                     |
| L+2      | LM head          | lm_head.weight (no file when tied: layer 0 holds it)  |

Phi-3's fused qkv_proj and gate_up_proj are held as their parts, q/k/v_proj and gate/up_proj (row blocks:
models/architecture.py's fused_projections), split on conversion and fused again on export.

A mixture-of-experts layer holds its experts fused, as transformers 5 does (models/moe.py); the hub's checkpoints,
and transformers' save_pretrained, hold one tensor per expert and projection (Mixtral's under its old module name,
block_sparse_moe): stacked on conversion (either layout is read), split again on export (GPT-OSS's stay fused).

The names above are the pipeline's: those of transformers' text-only CausalLM. A checkpoint as the hub ships it may
nest that text model (Qwen3.5's and Gemma's multimodal ones) and hold tensors the pipeline never runs (their vision
and audio towers, Qwen3.5's and DeepSeek-V3's multi-token-prediction layers): its HubLayout says where the text
model is and what is carried as it is, beside the layer files (CARRIED_FILE_NAME), for the export to write back.
"""
import copy
import dataclasses
import difflib
import json
import os
import re

import torch

from models.architecture import SUPPORTED_MODEL_TYPES, architecture_of, check_model_config, fused_projections

_DECODER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def num_pipeline_layers(num_hidden_layers):
    return num_hidden_layers + 3


# Gemma 4's per-layer embeddings (PLE): model-level tensors on the hub, of which each decoder layer computes with its
# own share, held in its own file under PER_LAYER_PREFIX so that a pipeline stage reads and saves only its layers':
# {name after `model.`: the dimension the layers' shares are cut along, one block of hidden_size_per_layer_input per
# layer in layer order; None: the whole tensor, in every layer (the norm the layers share, a tied weight)}.
PER_LAYER_TENSORS = {"embed_tokens_per_layer.weight": 1, "per_layer_model_projection.weight": 0,
                     "per_layer_projection_norm.weight": None}
PER_LAYER_PREFIX = "per_layer_inputs."


def per_layer_shares(name, config):
    """[(pipeline layer index, key in its state dict, dimension, first, width)] of a Hugging Face per-layer-embedding
    tensor (dimension None: the whole tensor); None for any other name."""
    short = name.removeprefix("model.")
    if not name.startswith("model.") or short not in PER_LAYER_TENSORS:
        return None
    dim, width = PER_LAYER_TENSORS[short], config.hidden_size_per_layer_input
    return [(layer + 1, PER_LAYER_PREFIX + short, dim, layer * width, width)
            for layer in range(config.num_hidden_layers)]


def per_layer_share(tensor, share):
    """A layer's share of a per-layer-embedding tensor (a view): per_layer_shares' entry."""
    _, _, dim, first, width = share
    return tensor if dim is None else tensor.narrow(dim, first, width)


def joined_per_layer_tensor(name, layer_tensors):
    """The Hugging Face tensor `name` (after `model.`) from its layers' shares, in layer order: concatenated along
    its dimension, or the first layer's copy of a whole one."""
    dim = PER_LAYER_TENSORS[name]
    return layer_tensors[0] if dim is None else torch.cat(layer_tensors, dim)


def layer_of_hf_name(name, num_hidden_layers, tie_word_embeddings):
    """(layer index, key inside that layer's state dict) for a Hugging Face weight name; None if unknown."""
    if name == "model.embed_tokens.weight":
        return 0, "weight"
    if name == "model.norm.weight":
        return num_hidden_layers + 1, "weight"
    if name == "lm_head.weight":
        return (0 if tie_word_embeddings else num_hidden_layers + 2), "weight"
    match = _DECODER.match(name)
    if match and int(match.group(1)) < num_hidden_layers:
        return int(match.group(1)) + 1, match.group(2)
    return None


def hf_name_of_layer_key(index, key, num_hidden_layers):
    if index == 0:
        return f"model.embed_tokens.{key}"
    if index <= num_hidden_layers:
        return f"model.layers.{index - 1}.{key}"
    if index == num_hidden_layers + 1:
        return f"model.norm.{key}"
    return f"lm_head.{key}"


def layer_file_name(index):
    # DeepSpeed's loader globs layer_{idx:02d}-*model_states.pt, so at least two digits.
    return f"layer_{index:02d}-model_states.pt"


def layer_file_path(tag_dir, index):
    return os.path.join(tag_dir, layer_file_name(index))


def expert_shard_file_name(index, shard, shards, kind="model"):
    """A training checkpoint's file of a layer's experts shard/shards (experts [shard E/shards, (shard + 1)
    E/shards) of each expert tensor, its weights or, kind "optim", its optimizer state), which the expert-parallel
    rank holding them writes: layer_05-experts_01-of-04-model_states.pt. DeepSpeed's glob of a layer's files finds
    these too; expert_shard_of tells them from its tensor-parallel slices."""
    return f"layer_{index:02d}-experts_{shard:02d}-of-{shards:02d}-{kind}_states.pt"


_EXPERT_SHARD = re.compile(r"^layer_\d+-experts_(\d+)-of-(\d+)-(?:model|optim)_states\.pt$")


def expert_shard_of(path):
    """(shard, shards) of an expert shard file's path, or None for any other file."""
    match = _EXPERT_SHARD.match(os.path.basename(path))
    return (int(match.group(1)), int(match.group(2))) if match else None


def layer_indices_with_files(num_hidden_layers, tie_word_embeddings):
    last = num_hidden_layers + 1 if tie_word_embeddings else num_hidden_layers + 2
    return range(0, last + 1)


# A fused projection's tensors: the weight and a LoRA adapter's B stack their parts' rows; its adapter's A is one,
# which the parts share (models/lora.py).
ROW_STACKED, SHARED = ("lora_B.weight", "weight"), "lora_A.weight"  # longest suffix first


def split_projections(config):
    """fused_projections of the families the pipeline splits; a family converted by its hub layout keeps every
    tensor as stored (Qwen3-Next's in_proj_qkvz and in_proj_ba too: the model part takes them fused)."""
    return {} if config.model_type in HUB_LAYOUTS else fused_projections(config)


def fused_parts(name, config):
    """((the part's HF name, first row, rows), ...) of a fused Hugging Face tensor (rows None: the whole tensor, a
    shared adapter A, held by the first part); None for any other name."""
    match = _DECODER.match(name)
    suffix = next((s for s in (SHARED, *ROW_STACKED) if match and match.group(2).endswith(f".{s}")), None)
    parts = split_projections(config).get(match.group(2).removesuffix(f".{suffix}")) if suffix else None
    if parts is None:
        return None
    prefix = f"model.layers.{match.group(1)}."
    if suffix == SHARED:
        return ((f"{prefix}{parts[0][0]}.{suffix}", 0, None),)
    starts = [sum(rows for _, rows in parts[:i]) for i in range(len(parts))]
    return tuple((f"{prefix}{part}.{suffix}", start, rows) for (part, rows), start in zip(parts, starts))


def split_fused(state, config):
    """{HF name: tensor} with each fused tensor replaced by its parts (views), as the pipeline names them."""
    split = {}
    for name, tensor in state.items():
        parts = fused_parts(name, config)
        split.update({name: tensor} if parts is None else
                     {part: tensor if rows is None else tensor[start:start + rows] for part, start, rows in parts})
    return split


def fuse(values, config, join=lambda parts, stacked: torch.cat(parts) if stacked else parts[0]):
    """{HF name: value} with each fused weight's or adapter's parts joined back: join(the parts' values, whether
    they stack), by default their tensors' rows stacked, or the shared A."""
    fused = dict(values)
    for name, (parts, stacked) in fused_groups(config, values).items():
        fused[name] = join([fused.pop(part) for part in parts], stacked)
    return fused


def fused_groups(config, names):
    """{fused HF name: (its parts' HF names among `names`, whether they stack)} of the fused weights and adapters:
    the parts' rows stacked in order, or (a shared A) the first part's tensor, the others being the same one."""
    groups = {}
    for layer in range(config.num_hidden_layers):
        for module, parts in split_projections(config).items():
            for suffix in (*ROW_STACKED, SHARED):
                part_names = [f"model.layers.{layer}.{part}.{suffix}" for part, _ in parts]
                present = [name for name in part_names if name in names]
                if present:
                    groups[f"model.layers.{layer}.{module}.{suffix}"] = (present, suffix != SHARED)
    return groups


# The hub's per-expert layout of each MoE family: (the layer's MoE module, {fused key: its per-expert tensors, in
# the order each expert's block stacks them}).
HUB_EXPERTS = {"mixtral": ("block_sparse_moe.", {"experts.gate_up_proj": ("w1.weight", "w3.weight"),
                                                  "experts.down_proj": ("w2.weight",)})}
HUB_EXPERTS.update(dict.fromkeys(("qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "qwen3_5_moe_text",
                                  "qwen3_next"), ("mlp.", {
    "experts.gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "experts.down_proj": ("down_proj.weight",)})))
# A decoder layer's, or Qwen3.5-MoE's MTP layer's (mtp.layers.0.*, which its checkpoint stores per expert while
# the decoder layers' experts are fused)
_HUB_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(.+)$")


def expert_piece(name, config):
    """(the pipeline's HF name of the fused tensor, the piece's place in its stack, pieces per expert) of a hub
    per-expert tensor (model.layers.1.mlp.experts.3.up_proj.weight: layer 1's mlp.experts.gate_up_proj, piece 7,
    2); None for any other name."""
    match = _HUB_EXPERT.match(name)
    module, fused = HUB_EXPERTS.get(config.model_type, (None, {}))
    if match is None or f"{match.group(2)}." != module:
        return None
    layer, expert, part = match.group(1), int(match.group(3)), match.group(4)
    for key, parts in fused.items():
        if part in parts:
            return f"{layer}.mlp.{key}", expert * len(parts) + parts.index(part), len(parts)
    return None


def per_expert_pieces(name, config):
    """[(hub name, (expert, part, parts))] of a fused experts tensor (model.layers.1.mlp.experts.gate_up_proj, or an
    MTP layer's), one tensor per expert and projection as the hub stores them; None for any other name."""
    prefix, _, key = name.rpartition("experts.")
    parts = HUB_EXPERTS.get(config.model_type, ("mlp.", {}))[1].get(f"experts.{key}")
    if not prefix or parts is None:
        return None
    return [(f"{prefix}experts.{expert}.{part}", (expert, index, len(parts)))
            for expert in range(num_experts(config)) for index, part in enumerate(parts)]


def pipeline_name(name, config):
    """The pipeline's HF name of a hub name: Mixtral's old block_sparse_moe module is transformers 5's mlp."""
    module = HUB_EXPERTS.get(config.model_type, ("mlp.",))[0]
    return name.replace(f".{module}", ".mlp.", 1) if module != "mlp." and _DECODER.match(name) else name


def hub_pieces(name, config, layout=None):
    """[(hub name, (expert, part, parts) or None)] of a pipeline HF name, as the checkpoint of `layout` (default:
    PLAIN_LAYOUT, as transformers' save_pretrained writes a text model) names it: under the layout's text prefix, an
    MoE layer's fused experts as each expert's projections (expert e's part p of `parts` row blocks of tensor[e])
    unless the layout holds them fused, Mixtral's module renamed; None: the whole tensor."""
    layout = layout or PLAIN_LAYOUT
    if not name.startswith("model.") and name != "lm_head.weight":  # outside the text model (Qwen3.5's mtp.*)
        return [(name, None)]
    module = HUB_EXPERTS.get(config.model_type, ("mlp.", {}))[0]
    match = _DECODER.match(name)
    if match is None or not match.group(2).startswith("mlp."):
        return [(layout.to_hub(name), None)]
    layer, key = int(match.group(1)), match.group(2).removeprefix("mlp.")
    prefix = layout.to_hub(f"model.layers.{layer}.{module}")
    pieces = per_expert_pieces(f"{prefix}{key}", config) if layout.experts_apart else None
    return pieces or [(f"{prefix}{key}", None)]  # only a sparse layer holds fused experts


def num_experts(config):
    """The routed experts of an MoE layer: the pipeline's count, or the config's for a family converted by its hub
    layout (Qwen3.5-MoE, Qwen3-Next)."""
    return config.num_experts if config.model_type in HUB_LAYOUTS else architecture_of(config).moe.num_experts


def hub_piece(tensor, piece):
    """The view of a fused tensor that a hub_pieces entry names."""
    if piece is None:
        return tensor
    expert, index, parts = piece
    return tensor[expert].chunk(parts)[index]


# The multi-token-prediction layers a DeepSeek-V3 or GLM-4.5 checkpoint ships after its decoder layers
# (num_nextn_predict_layers of them, model.layers.{L}.* on): transformers' CausalLM forward never runs them (they
# serve speculative decoding), nor does the pipeline; conversion carries them as they are.
def is_multi_token_prediction(name, config):
    """Whether a Hugging Face weight belongs to a multi-token-prediction layer."""
    match = _DECODER.match(name)
    extra = getattr(config, "num_nextn_predict_layers", 0) or 0
    return bool(match) and config.num_hidden_layers <= int(match.group(1)) < config.num_hidden_layers + extra


# The tensors of a checkpoint the pipeline does not run, under their hub names, as they were (bytes and dtypes), in
# this file of the converted tag: a training checkpoint carries its base's (checkpoints/saving.py), export writes
# them back. Its metadata records the HubLayout the checkpoint was read with (HUB_LAYOUT_KEY), for the export to
# write the text model's tensors under the names they had.
CARRIED_FILE_NAME = "carried_tensors.safetensors"
HUB_LAYOUT_KEY = "hub_layout"


@dataclasses.dataclass(frozen=True)
class HubLayout:
    """Where a checkpoint keeps the text model the pipeline trains, and what else it holds. The text model's hub
    names are the pipeline's with `model.` replaced by text_prefix and lm_head.weight by head; a tensor under one of
    carried_prefixes (a vision or audio tower, Qwen3.5's MTP layer) is carried as it is. experts_apart: whether an
    MoE layer's experts are stored one tensor per expert and projection (transformers' save_pretrained, Qwen3-Next
    on the hub) or fused (Qwen3.5-MoE and Qwen3.6-MoE on the hub)."""
    text_prefix: str = "model."
    head: str = "lm_head.weight"
    carried_prefixes: tuple = ()
    experts_apart: bool = True

    def from_hub(self, name):
        """The pipeline's HF name of a hub name of the text model; None for any other."""
        if name == self.head:
            return "lm_head.weight"
        if name.startswith(self.carried_prefixes) or not name.startswith(self.text_prefix):
            return None
        return f"model.{name.removeprefix(self.text_prefix)}"

    def to_hub(self, name):
        if name == "lm_head.weight":
            return self.head
        return f"{self.text_prefix}{name.removeprefix('model.')}"

    def record(self):
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_record(cls, text):
        fields = json.loads(text)
        return cls(**{**fields, "carried_prefixes": tuple(fields["carried_prefixes"])})


PLAIN_LAYOUT = HubLayout()  # a text-only checkpoint: model.embed_tokens, model.layers.{i}, model.norm, lm_head
QWEN3_5_MULTIMODAL = HubLayout("model.language_model.", carried_prefixes=("model.visual.", "mtp."))
# The families converted by their hub layout, whose layer files hold their text model's tensors as stored (no
# fused projection split): {model_type: its layouts on the hub, the one whose embedding a checkpoint holds is its}.
# Their names and shapes are checked against transformers' own text model (checkpoints/hf_to_ds.py); whether the
# pipeline trains them is the model's business (models/architecture.py).
HUB_LAYOUTS = {
    "qwen3_5": (QWEN3_5_MULTIMODAL,),
    "qwen3_5_moe": (QWEN3_5_MULTIMODAL,),
    # a text-only config over the multimodal checkpoint loads too (transformers' PrefixChange of language_model)
    "qwen3_5_text": (HubLayout(carried_prefixes=("mtp.",)), QWEN3_5_MULTIMODAL),
    "qwen3_5_moe_text": (HubLayout(carried_prefixes=("mtp.",)), QWEN3_5_MULTIMODAL),
    "qwen3_next": (HubLayout(carried_prefixes=("mtp.",)),),
    # the hub's Gemma 3 (and transformers' save_pretrained): the llava layout; transformers' own module names too
    "gemma3": (HubLayout("language_model.model.", "language_model.lm_head.weight",
                         ("vision_tower.", "multi_modal_projector.")),
               HubLayout("model.language_model.",
                         carried_prefixes=("model.vision_tower.", "model.multi_modal_projector."))),
    "gemma3_text": (PLAIN_LAYOUT,),
    "gemma4": (HubLayout("model.language_model.", carried_prefixes=(
        "model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")),),
    "gemma4_text": (PLAIN_LAYOUT,),
    "olmo3": (PLAIN_LAYOUT,),
}
# an MoE layer's experts stored fused: under mlp. (Qwen3.5-MoE), or beside the dense MLP (Gemma 4's layers.{i}.experts)
_FUSED_EXPERTS = re.compile(r"^model\.layers\.\d+\.(mlp\.)?experts\.(gate_up_proj|down_proj)$")


def hub_layout_of(model_type, names):
    """The HubLayout of a checkpoint of model_type holding the tensors `names`: of its family's layouts the one whose
    embedding it holds, with its experts as it stores them."""
    layouts = HUB_LAYOUTS.get(model_type, (PLAIN_LAYOUT,))
    layout = next((c for c in layouts if c.to_hub("model.embed_tokens.weight") in names), layouts[0])
    fused = any(_FUSED_EXPERTS.match(layout.from_hub(name) or "") for name in names)
    return dataclasses.replace(layout, experts_apart=not fused)


def is_carried(name, config, layout, unused_patterns=()):
    """Whether conversion carries a hub tensor as it is rather than into a layer file: under a carried prefix, a
    multi-token-prediction layer, or a text-model tensor that transformers' model does not hold and ignores on load
    (unused_patterns, its _keys_to_ignore_on_load_unexpected: the hub's Gemma 4 E2B/E4B still ship their KV-shared
    layers' unused k/v projections and norms)."""
    if name.startswith(layout.carried_prefixes):
        return True
    pipeline = layout.from_hub(name)
    return pipeline is not None and (is_multi_token_prediction(pipeline, config)
                                     or any(re.search(pattern, pipeline) for pattern in unused_patterns))


def text_config_of(config):
    """The config of the text model of a (possibly multimodal) config, with the head tied as transformers ties the
    checkpoint's model: by the top-level config's tie_word_embeddings."""
    text = config.get_text_config()
    if text is not config and text.tie_word_embeddings != config.tie_word_embeddings:
        text = copy.deepcopy(text)
        text.tie_word_embeddings = config.tie_word_embeddings
    return text


def check_convertible(config):
    """Refuse, in one line, a model_type whose checkpoint the map does not know; the pipeline's own families also
    have their config checked as training will check it (models/architecture.py check_model_config)."""
    if config.model_type in HUB_LAYOUTS:
        return
    if config.model_type in SUPPORTED_MODEL_TYPES:
        check_model_config(config)
        return
    supported = (*(t for t in SUPPORTED_MODEL_TYPES if t not in HUB_LAYOUTS), *HUB_LAYOUTS)
    nearest = difflib.get_close_matches(config.model_type, supported, n=1, cutoff=0.6)
    raise ValueError(f"model_type '{config.model_type}' is not supported; supported: {', '.join(supported)}"
                     + (f"; the nearest is '{nearest[0]}', whose layers differ from it." if nearest else "."))
