"""The math every attention of the decoder shares (models/llama.py's grouped-query Attention, models/
latent_attention.py's multi-head latent attention): the rotary embedding applied to a head's features, and softmax
attention over heads, through SDPA or the eager formula transformers' `eager` implementation computes.
"""
import torch
import torch.nn.functional as F

from models.context_parallel import causal_lower_right_attention


def additive_mask(allowed, dtype):
    """A boolean mask as the scores' additive one (0 where allowed, the dtype's minimum elsewhere), built once per
    stage: SDPA would otherwise convert a boolean mask per call and keep each layer's copy for backward."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:  # Phi's partial rotary embedding: the features past the rotary ones pass unrotated
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def deinterleave(x):
    """DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3), ... laid out as halves (x0, x2, ...), (x1, x3, ...),
    which apply_rotary rotates: transformers' apply_rotary_pos_emb_interleave returns this layout, rotated, to the
    last bit (x1 * cos - x2 * sin and x1 * cos + (-x2) * sin are the same floating-point numbers)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def attend(q, k, v, mask, attention_impl="sdpa", scale=None, sinks=None):
    """softmax(q k^T * scale + mask) v over heads (batch, heads, tokens, features); scale None: q's features ** -0.5.
    Grouped-query attention: each key/value head serves q heads / kv heads query heads. SDPA reads them as they are
    (enable_gqa); a copy per query head would be kept for backward, over the whole sequence under context
    parallelism. No mask: causal, the queries being the last of the keys (all of them, but under context parallelism
    a half's queries follow the keys of the chunks before it). sinks (GPT-OSS's) take the eager formula: SDPA has
    no logit outside the keys."""
    grouped = q.shape[1] != k.shape[1]
    if attention_impl == "sdpa" and sinks is None:
        if mask is None and q.shape[2] != k.shape[2]:
            return causal_lower_right_attention(q, k, v, grouped, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=grouped,
                                              scale=scale)
    if grouped:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return eager_attention(q, k, v, mask, scale, sinks)


def eager_attention(q, k, v, mask, scale=None, sinks=None):
    """sinks (GPT-OSS's, one logit per head): each query's softmax also over its head's sink, dropped after it
    (transformers' formula: the row's maximum subtracted first)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is None:  # causal, the queries ending the keys
        queries, keys = q.shape[-2], k.shape[-2]
        mask = additive_mask(torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries), q.dtype)
    if sinks is None:
        probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        scores = scores + mask
        combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v)
