"""The LLaMA-family model as pipeline layers: embedding, decoder layers, final norm, LM head, and the loss.

Every layer takes and returns what DeepSpeed's pipeline engine passes between layers. From the embedding to the
last decoder layer that is the tuple ``(hidden_states, document_ids, position_ids)``: only the hidden states are
floating point, because the engine sends a gradient back for every floating tensor that crosses a stage boundary.
The final norm and the LM head pass plain tensors. Parameter names inside each layer equal transformers' names
after the ``model.layers.{i}.`` prefix, so a layer's state dict is the Hugging Face one with the prefix stripped.

Every layer takes a ``parallel`` (models/tensor_parallel.py): it sizes the projections to this rank's share and
does the few collectives tensor parallelism needs; the default is the plain single-process computation. What each
model family changes (norms, multipliers, windows, rotary layers) comes from models/architecture.py.
"""
import functools

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from models.architecture import (ACTIVATIONS, architecture_of, check_model_config,  # noqa: F401 (re-exported)
                                 fused_projections, head_dim_of)
from models.attention_kernels import additive_mask, apply_rotary, attend
from models.context_parallel import NO_CONTEXT_PARALLEL
from models.latent_attention import LatentAttention
from models.moe import MoEBlock
from models.norms import HeadRMSNorm, ProjectionRMSNorm, RMSNorm
from models.router_loss import carry_routing, initial_routing, pack_stage, unpack_stage
from models.tensor_parallel import NO_TENSOR_PARALLEL


class RotaryEmbedding(nn.Module):
    """transformers' LlamaRotaryEmbedding (every rope_type, through its own init functions and dynamic update),
    written here because importing transformers' modeling code costs every rank ~130 MB of memory."""

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


ROW_LAYOUTS = ("packed", "padded", "full")  # what a run's rows hold: data/collator.py `row_layout`


class StageAttentionInputs:
    """The attention mask and rotary tables of one micro-batch, built once and shared by every decoder layer of
    the stage (a plain object, not a module, so it adds no parameters or buffers to the layers holding it). Under
    context parallelism the mask is one per local half of the tokens (models/context_parallel.py).

    Whether there is a mask is the run's, not the micro-batch's (reading the micro-batch's document ids to decide
    would stall the host until the device caught up, once per micro-batch): row_layout 'packed', rows of several
    documents, takes a mask per document; 'padded', one document then padding, none (causal attention, no mask
    tensor: SDPA may pick a flash kernel on GPUs) but under context parallelism, whose halves take the mask;
    'full', one document filling the row, none. Plain causal attention computes every real token of a one-document
    row exactly as the mask would, as none sees a later position; padding queries then see earlier tokens, but their
    labels are -100 and no real token reads them, so losses and gradients are the same."""

    def __init__(self, config, context=NO_CONTEXT_PARALLEL, row_layout="packed"):
        if row_layout not in ROW_LAYOUTS:
            raise ValueError(f"row_layout={row_layout!r} is not one of {', '.join(ROW_LAYOUTS)}.")
        self.rotary = RotaryEmbedding(config)
        self.context = context
        self.masked = row_layout == "packed" or (row_layout == "padded" and context.size > 1)
        self._key = None
        self._held = None  # the tensors the key's addresses belong to, kept alive so no other batch reuses them
        self._value = None
        self._masks = {}  # {window: mask} of the keyed batch, built when a layer of the stage first asks

    def __call__(self, hidden, document_ids, position_ids, window=None):
        """(cos, sin, mask) for a layer attending within `window` positions (None: the whole sequence)."""
        # Keyed on storage while the previous tensors are held, so a reused address cannot alias another batch.
        key = (document_ids.data_ptr(), document_ids._version, position_ids.data_ptr(), position_ids._version,
               tuple(document_ids.shape), hidden.dtype, hidden.device)
        if key != self._key:
            self.rotary.to(hidden.device)
            self._value = self.rotary(hidden, position_ids)
            self._masks = {}
            self._key = key
            self._held = (document_ids, position_ids)
        if window not in self._masks:
            self._masks[window] = self.mask(document_ids, hidden.dtype, window)
        return (*self._value, self._masks[window])

    def mask(self, document_ids, dtype, window):
        """The additive mask of a micro-batch (under context parallelism one per local half), None for none; a
        sliding window shorter than the row always takes one."""
        if self.context.size == 1:
            allowed = document_causal_mask(document_ids) if self.masked else None
            return additive_mask(within_window(allowed, window, document_ids), dtype)
        needed = self.masked or (window is not None and window < document_ids.shape[1] * self.context.size)
        halves = self.context.attention_masks(document_ids, window) if needed else [None, None]
        return [additive_mask(half, dtype) for half in halves]


def document_causal_mask(document_ids):
    """Boolean (batch, 1, seq, seq) mask, True where a query may attend: causal and within the query's document.

    document_ids (batch, seq): 0 on padding, k >= 1 on the tokens of a row's k-th document. A padding query sees
    only itself, so no query row is empty (no NaN) and no real token sees padding."""
    seq = document_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_document = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    allowed = causal[None, None] & same_document & (document_ids != 0)[:, None, None, :]
    return allowed | torch.eye(seq, dtype=torch.bool, device=document_ids.device)


def within_window(allowed, window, document_ids):
    """allowed (None: plain causal) narrowed to the keys within `window` positions of each query, itself included
    (transformers' sliding_window_overlay: key > query - window). A window as long as the sequence changes nothing."""
    seq = document_ids.shape[-1]
    if window is None or window >= seq:
        return allowed
    positions = torch.arange(seq, device=document_ids.device)
    offset = positions[:, None] - positions[None, :]
    near = (offset >= 0) & (offset < window)
    return near[None, None] if allowed is None else allowed & near


class Attention(nn.Module):
    def __init__(self, config, attention_impl, parallel=NO_TENSOR_PARALLEL, context=NO_CONTEXT_PARALLEL,
                 layer_index=0):
        super().__init__()
        architecture = architecture_of(config)
        self.context = context
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = head_dim_of(config)
        self.attention_impl = attention_impl
        self.scale = architecture.attention_scale  # None: head_dim ** -0.5
        self.rotary = architecture.rotary_layers[layer_index]
        self.window = architecture.sliding_windows[layer_index]
        qkv_bias, o_bias = architecture.qkv_bias, architecture.o_bias
        hidden, self.parallel = config.hidden_size, parallel
        # Each rank computes whole heads: its query heads and the key/value heads they attend with.
        heads = parallel.local(self.num_heads, "num_attention_heads")
        kv_heads = parallel.local(self.num_kv_heads, "num_key_value_heads")
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=o_bias)
        for projection in (self.q_proj, self.k_proj, self.v_proj):
            parallel.mark_sharded(projection, dim=0)
        parallel.mark_sharded(self.o_proj, dim=1)
        self.qk_norm = architecture.qk_norm
        if self.qk_norm == "head":
            self.q_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps, parallel)
            self.k_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps, parallel)
        elif self.qk_norm == "projection":
            norm = functools.partial(ProjectionRMSNorm, eps=config.rms_norm_eps, parallel=parallel,
                                     scale_in_fp32=architecture.norm_scale_in_fp32)
            self.q_norm, self.k_norm = norm(self.num_heads * self.head_dim), norm(self.num_kv_heads * self.head_dim)
        if architecture.attention_sinks:  # GPT-OSS: one learned logit per head, split with the heads
            self.sinks = nn.Parameter(torch.zeros(heads))
            parallel.mark_sharded(self, dim=0)

    def forward(self, x, cos, sin, mask, batch, seq):
        q, k, v = self.parallel.column_linears(x, (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.rotary:  # SmolLM3 leaves some layers without
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = self.context.gather_keys_values(k, v)  # the whole sequence's, under context parallelism
        out = self.context.attend(self.attend, q, k, v, mask)
        return self.parallel.row_linear(out.transpose(1, 2).reshape(batch, seq, -1), self.o_proj)

    def attend(self, q, k, v, mask):
        """Attention sinks (GPT-OSS) take the eager formula whatever attention_impl says: SDPA has no logit outside
        the keys."""
        return attend(q, k, v, mask, self.attention_impl, self.scale, getattr(self, "sinks", None))


class MLP(nn.Module):
    """width: another dense MLP's intermediate features (an MoE layer's shared expert); None: intermediate_size."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL, width=None):
        super().__init__()
        bias = architecture_of(config).mlp_bias
        inter = parallel.local(width or config.intermediate_size,
                               "intermediate_size" if width is None else "the shared expert's width")
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)
        parallel.mark_sharded(self.gate_proj, dim=0)
        parallel.mark_sharded(self.up_proj, dim=0)
        parallel.mark_sharded(self.down_proj, dim=1)
        self.act_fn = ACTIVATIONS[config.hidden_act]
        self.parallel = parallel

    def forward(self, x):
        gate, up = self.parallel.column_linears(x, (self.gate_proj, self.up_proj))
        return self.parallel.row_linear(self.act_fn(gate) * up, self.down_proj)


class EmbeddingPipe(nn.Embedding):
    """Layer 0: token ids to hidden states; document ids and positions pass through as integer tensors (and an MoE
    model's routing statistics start: models/router_loss.py).

    As transformers builds it (padding_idx=config.pad_token_id): the pad token's row takes no gradient from the
    lookup, which matters where pad is a real token (pad = eos; ChatML's <|im_end|>). Under tensor parallelism the
    row lives on the rank whose vocabulary share holds it (padding_idx there, None on the others)."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL):
        rows = parallel.local(config.vocab_size, "vocab_size")
        pad = getattr(config, "pad_token_id", None)
        mine = pad is not None and parallel.rank * rows <= pad < (parallel.rank + 1) * rows
        super().__init__(rows, config.hidden_size, padding_idx=pad - parallel.rank * rows if mine else None)
        parallel.mark_sharded(self, dim=0)
        self.parallel = parallel
        self.multiplier = architecture_of(config).embedding_multiplier  # Granite's
        self.routing = functools.partial(initial_routing, config)  # an MoE model's statistics start here

    def forward(self, inputs):
        input_ids, document_ids, position_ids = inputs
        embedded = self.parallel.embedding(input_ids, self.weight, self.padding_idx)
        return pack_stage(scaled(embedded, self.multiplier), document_ids, position_ids, self.routing(embedded.device))


class DecoderLayerPipe(nn.Module):
    """hidden_states are (batch, seq, hidden), or under sequence parallelism this rank's share of the
    flattened tokens (batch * seq / tp, hidden); the document ids give batch and seq either way.

    A sparse layer's MLP is the MoE block (models/moe.py), its experts run by `dispatcher` (None: all on this
    rank). An MoE model's tuple carries routing statistics too (models/router_loss.py): integers, and with the
    load-balancing loss a float sum that every router's gradient comes back through."""

    def __init__(self, config, stage_inputs, attention_impl="sdpa", parallel=NO_TENSOR_PARALLEL,
                 context=NO_CONTEXT_PARALLEL, layer_index=0, dispatcher=None):
        super().__init__()
        architecture = architecture_of(config)
        self.post_norms, self.residual_multiplier = architecture.post_norms, architecture.residual_multiplier
        norm = functools.partial(RMSNorm, config.hidden_size, config.rms_norm_eps, parallel,
                                 scale_in_fp32=architecture.norm_scale_in_fp32)
        if not self.post_norms:
            self.input_layernorm = norm()
        attention = LatentAttention if architecture.latent_attention else Attention
        self.self_attn = attention(config, attention_impl, parallel, context, layer_index)
        self.post_attention_layernorm = norm()
        self.sparse = architecture.sparse_layers[layer_index]
        self.sparse_row = sum(architecture.sparse_layers[:layer_index])  # its row of the routing counts
        if self.sparse:
            shared = MLP(config, parallel, architecture.moe.shared_expert_size) if architecture.moe.shared_expert_size \
                else None
            self.mlp = MoEBlock(config, parallel, dispatcher, shared)
        else:
            self.mlp = MLP(config, parallel)
        if self.post_norms:
            self.post_feedforward_layernorm = norm()
        self.stage_inputs = stage_inputs
        # Phi-3's fused projections, by their parts' names here (LoRA gives each group one shared A, as peft does).
        self.fused_groups = tuple(tuple(part.rsplit(".", 1)[-1] for part, _ in parts)
                                  for parts in fused_projections(config).values())

    def forward(self, inputs):
        hidden, document_ids, position_ids, routing = unpack_stage(inputs)
        cos, sin, mask = self.stage_inputs(hidden, document_ids, position_ids, self.self_attn.window)
        batch, seq = document_ids.shape
        if not self.sparse:
            hidden = self.residual_blocks(hidden, cos, sin, mask, batch, seq)
        else:
            hidden, statistics = self.residual_blocks(hidden, cos, sin, mask, batch, seq, document_ids)
            routing = carry_routing(routing, statistics, self.sparse_row)
        return pack_stage(hidden, document_ids, position_ids, routing)

    def residual_blocks(self, hidden, cos, sin, mask, batch, seq, document_ids=None):
        """The layer's math: the new hidden states, and for a sparse layer (document_ids: the micro-batch's, 0 on
        padding) its routing statistics."""
        if self.post_norms:  # OLMo 2: each sublayer's output normalised before the residual add
            hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, cos, sin, mask, batch, seq))
            return hidden + self.post_feedforward_layernorm(self.mlp(hidden))
        attention = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, batch, seq)
        hidden = hidden + scaled(attention, self.residual_multiplier)
        if self.sparse:
            out, statistics = self.mlp(self.post_attention_layernorm(hidden), document_ids)
            return hidden + scaled(out, self.residual_multiplier), statistics
        return hidden + scaled(self.mlp(self.post_attention_layernorm(hidden)), self.residual_multiplier)

    def compile(self, *args, **kwargs):
        """torch.compile the layer's math only: the stage's shared attention inputs stay a Python-side cache."""
        self.residual_blocks = torch.compile(self.residual_blocks, *args, **kwargs)


class FinalNormPipe(RMSNorm):
    """Layer L+1: drops document ids and positions, which nothing after it needs (an MoE model's routing statistics
    go on to the loss). Granite divides its logits by logits_scaling: done here, to the LM head's input (the head is
    linear), so every loss path sees it."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL):
        architecture = architecture_of(config)
        super().__init__(config.hidden_size, config.rms_norm_eps, parallel,
                         scale_in_fp32=architecture.norm_scale_in_fp32)
        self.logits_multiplier = 1 / architecture.logits_scaling

    def forward(self, inputs):
        hidden, _, _, routing = unpack_stage(inputs if len(inputs) > 1 else (*inputs, None, None))
        normed = scaled(super().forward(hidden), self.logits_multiplier)
        return (normed, *routing) if routing else normed


def scaled(x, multiplier):
    """x * multiplier (Granite's multipliers); the same x, with no kernel, at 1."""
    return x if multiplier == 1 else x * multiplier


class LMHeadPipe(nn.Linear):
    """Layer L+2: hidden states to logits (this rank's vocabulary rows under tensor parallelism); with
    chunked_loss, the hidden states and the weight, which the loss projects a chunk of tokens at a time
    (models/loss.py), so no layer output holds the logits."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL, chunked_loss=False):
        super().__init__(config.hidden_size, parallel.local(config.vocab_size, "vocab_size"), bias=False)
        parallel.mark_sharded(self, dim=0)
        self.parallel, self.chunked_loss = parallel, chunked_loss

    def forward(self, hidden):
        return lm_head(self, hidden, self.chunked_loss)


def lm_head(module, inputs, chunked_loss=False):
    """The LM head of `module`'s weight: its own, or the embedding's when tied (DeepSpeed's TiedLayerSpec calls
    forward_fn(embedding, inputs)). inputs: the hidden states, or those and an MoE model's routing statistics,
    which follow the head's outputs to the loss (models/loss.py head_outputs)."""
    hidden, *routing = inputs if isinstance(inputs, tuple) else (inputs,)
    if chunked_loss:
        # A view, not the leaf: DeepSpeed hooks the outputs that have a grad_fn to start each backward (the bf16
        # optimizer clears its gradients there), and so runs that before the weight's gradient accumulates.
        return hidden, module.weight.view_as(module.weight), *routing
    logits = module.parallel.column_linears(hidden, [module])[0]
    return (logits, *routing) if routing else logits


def layers_on_meta(config, parallel=NO_TENSOR_PARALLEL):
    """{pipeline index: module} with one decoder layer standing for all of its kind (dense or sparse), built on the
    meta device (no memory): the shapes and split dimensions of every layer file."""
    sparse = architecture_of(config).sparse_layers
    with torch.device("meta"):
        decoders = {kind: DecoderLayerPipe(config, stage_inputs=None, parallel=parallel, layer_index=sparse.index(kind))
                    for kind in set(sparse)}
        modules = {0: EmbeddingPipe(config, parallel), config.num_hidden_layers + 1: FinalNormPipe(config, parallel)}
        if not config.tie_word_embeddings:
            modules[config.num_hidden_layers + 2] = LMHeadPipe(config, parallel)
    modules.update({i + 1: decoders[kind] for i, kind in enumerate(sparse)})
    return modules
