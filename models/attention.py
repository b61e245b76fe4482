"""Grouped-query attention (every family's token mixer but DeepSeek-V3's), and the rotary tables and masks every
decoder layer reads, built once per batch.

A layer's attention is its projections, its query/key norms where the family has them, the rotary embedding, and an
`AttentionCore` (softmax attention of the queries over the keys and values, no parameters) that context parallelism
replaces with its own around the same math (models/context_parallel.py). A layer takes the rows' shape from its
attention inputs, never from the hidden states, so it reads hidden states laid out as (batch, seq, hidden) or as the
rows' tokens flattened alike.
"""
import functools
from typing import NamedTuple

import torch
from torch import nn

from models.architecture import architecture_of, head_dim_of
from models.attention_kernels import additive_mask, apply_rotary, attend as softmax_attention
from models.norms import HeadRMSNorm, ProjectionRMSNorm
from models.rotary import RotaryEmbedding

ROW_LAYOUTS = ("packed", "padded", "full")  # what a run's rows hold: data/collator.py `row_layout`


class AttentionInputs(NamedTuple):
    """What every attention layer of a batch reads: the rotary tables (batch, seq, rotary features) of the rows'
    positions and the additive mask (None: causal, no tensor); and what a linear-attention layer reads instead of a
    mask, the rows' document ids (batch, seq) where they hold packed documents (None: each row one document, or one
    then padding, which no real token's recurrence reads)."""
    cos: torch.Tensor
    sin: torch.Tensor
    mask: object
    document_ids: torch.Tensor | None = None

    @property
    def rows(self):
        """(batch, seq) of the rows these inputs are for."""
        return self.cos.shape[:2]


class StageAttentionInputs:
    """The attention mask and rotary tables of one batch, built once and shared by every decoder layer that reads
    them (a pipeline stage's, or the whole single-device model's); a plain object, not a module, so it adds no
    parameters or buffers to the layers holding it.

    Whether there is a mask is the run's, not the batch's (reading the batch's document ids to decide would stall
    the host until the device caught up, once per micro-batch): row_layout 'packed', rows of several documents,
    takes a mask per document; 'padded', one document then padding, none (causal attention, no mask tensor: SDPA may
    pick a flash kernel on GPUs); 'full', one document filling the row, none. Plain causal attention computes every
    real token of a one-document row exactly as the mask would, as none sees a later position; padding queries then
    see earlier tokens, but their labels are -100 and no real token reads them, so losses and gradients are the
    same."""

    def __init__(self, config, row_layout="packed"):
        if row_layout not in ROW_LAYOUTS:
            raise ValueError(f"row_layout={row_layout!r} is not one of {', '.join(ROW_LAYOUTS)}.")
        self.rotary = RotaryEmbedding(config)
        self.masked = row_layout == "packed"
        self._key = None
        self._held = None  # the tensors the key's addresses belong to, kept alive so no other batch reuses them
        self._value = None
        self._masks = {}  # {window: mask} of the keyed batch, built when a layer first asks

    def __call__(self, hidden, document_ids, position_ids, window=None):
        """The AttentionInputs of a layer attending within `window` positions (None: the whole sequence)."""
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
        return AttentionInputs(*self._value, self._masks[window], document_ids if self.masked else None)

    def mask(self, document_ids, dtype, window):
        """The additive mask of a batch, None for none; a sliding window shorter than the row always takes one."""
        allowed = document_causal_mask(document_ids) if self.masked else None
        return additive_mask(within_window(allowed, window, document_ids), dtype)


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


class AttentionCore(nn.Module):
    """Softmax attention of queries (batch, heads, tokens, features) over keys and values: `keys_values`, expanded
    by `expand` first where the layer holds them compressed (multi-head latent attention's latent). GPT-OSS's sinks
    take the eager formula whatever attention_impl says: SDPA has no logit outside the keys."""

    def __init__(self, attention_impl="sdpa", scale=None):
        super().__init__()
        self.attention_impl, self.scale = attention_impl, scale

    def forward(self, q, keys_values, mask, expand=None, sinks=None):
        k, v = keys_values if expand is None else expand(*keys_values)
        return self.attend(q, k, v, mask, sinks)

    def attend(self, q, k, v, mask, sinks=None):
        return softmax_attention(q, k, v, mask, self.attention_impl, self.scale, sinks)


class Attention(nn.Module):
    """The attention of a decoder layer: each query head attends with the key/value head of its group, through the
    rotary embedding (but on the layers SmolLM3 leaves without), within the layer's sliding window if it has one."""

    def __init__(self, config, attention_impl="sdpa", layer_index=0):
        super().__init__()
        architecture = architecture_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = head_dim_of(config)
        self.rotary = architecture.rotary_layers[layer_index]
        self.window = architecture.sliding_windows[layer_index]
        hidden, qkv_bias = config.hidden_size, architecture.qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=architecture.o_bias)
        self.qk_norm = architecture.qk_norm
        if self.qk_norm == "head":
            self.q_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps)
        elif self.qk_norm == "projection":
            norm = functools.partial(ProjectionRMSNorm, eps=config.rms_norm_eps,
                                     scale_in_fp32=architecture.norm_scale_in_fp32)
            self.q_norm, self.k_norm = norm(self.num_heads * self.head_dim), norm(self.num_kv_heads * self.head_dim)
        if architecture.attention_sinks:  # GPT-OSS: one learned logit per head
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.core = AttentionCore(attention_impl, architecture.attention_scale)

    def reset_parameters(self):
        if hasattr(self, "sinks"):
            nn.init.zeros_(self.sinks)

    def forward(self, x, inputs):
        batch, seq = inputs.rows
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.rotary:
            q, k = apply_rotary(q, inputs.cos, inputs.sin), apply_rotary(k, inputs.cos, inputs.sin)
        out = self.core(q, (k, v), inputs.mask, sinks=getattr(self, "sinks", None))
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
