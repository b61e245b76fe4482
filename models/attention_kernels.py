"""The math every attention of the decoder shares (grouped-query attention, models/attention.py; multi-head latent
attention, models/latent_attention.py): the rotary embedding applied to a head's features, and softmax attention
over heads, through SDPA or the eager formula transformers' `eager` implementation computes.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


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


def causal_lower_right_attention(q, k, v, grouped, scale=None):
    """Causal attention of queries that are the last q.shape[2] of the keys (each half's queries end its keys), with
    no mask tensor: CUDA's flash kernels align a causal mask there (torch's causal_lower_right), but the CPU's aligns
    it at the first key and SDPA would materialise the mask and keep it per layer for backward."""
    if q.device.type == "cpu":
        if v.shape[-1] != q.shape[-1]:  # MLA's values: the CPU kernel takes one width, so zeros pad the narrower
            width, scale = max(q.shape[-1], v.shape[-1]), q.shape[-1] ** -0.5 if scale is None else scale
            q, k, padded = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
            return LowerRightCausalOnCPU.apply(q, k, padded, scale)[..., :v.shape[-1]]
        return LowerRightCausalOnCPU.apply(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          enable_gqa=grouped, scale=scale)


class LowerRightCausalOnCPU(torch.autograd.Function):
    """The keys before the queries' own block (all visible) and that block (causal from its first key) through the
    CPU flash kernel apart, merged by their log-sum-exps; backward runs each part's kernel with the merged output
    and log-sum-exp, which gives exactly the gradient of the whole (ring attention's merge). No torch op exposes
    the kernel's log-sum-exp but this private one."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        prefix = k.shape[2] - q.shape[2]
        before, before_lse = flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
        block, block_lse = flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
        lse = torch.logaddexp(before_lse, block_lse)
        out = (before.float() * (before_lse - lse).exp()[..., None]
               + block.float() * (block_lse - lse).exp()[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        prefix = k.shape[2] - q.shape[2]
        grad = grad.contiguous()
        dq_before, dk_before, dv_before = flash_backward(grad, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, 0.0,
                                                         False, scale=ctx.scale)
        dq_block, dk_block, dv_block = flash_backward(grad, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, 0.0,
                                                      True, scale=ctx.scale)
        return (dq_before + dq_block, torch.cat([dk_before, dk_block], 2), torch.cat([dv_before, dv_block], 2),
                None)
