"""The gated delta rule, the core of Gated DeltaNet's token mixer (Qwen3.5, Qwen3-Next), chunked as transformers'
torch path computes it (torch_chunk_gated_delta_rule, chunks of 64 tokens), with what that path cannot do: packed
documents kept apart, and a backward written out by hand instead of autograd through the scan over chunks.

Per value head, with the key head it shares (key head j serves value heads j * r .. j * r + r - 1, r = value heads /
key heads), the state S [key features, value features] runs over the tokens as

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,    o_t = S_t^T q_t

with q and k L2-normalised and q scaled by key features ** -0.5; q, k, v, g, beta and the state are fp32 whatever the
inputs' dtype, the output cast back to the query's. A chunk of tokens is solved at once (the UT transform: a unit
lower-triangular system per chunk) and the state carried from chunk to chunk, each chunk an affine map of it:

    v_new = u - w S,    o = (e * q) S + P v_new,    S' = gamma S + (f * k)^T v_new

(u, w: the system's solutions for beta * v and beta * exp(cumulated g) * k; P: the chunk's decayed q k^T; e, f,
gamma: the decays from the chunk's start to each token, from each token to its end, over the whole chunk).

Packed documents: where the document id changes the state restarts at zero, so each document's output is the one it
would have alone. Inside a chunk that is a mask on the token pairs of different documents, a zero on the decays that
would carry the state into a token of a document starting in the chunk (e), out of a token of a document ending in
it (f), and across the whole chunk (gamma): no host sync, the row's layout unchanged.

Context parallelism chains ranks exactly through `initial_state` (the state before the first token, carried into the
first token's document; its gradient is returned) and the final state (the state after the last token, whose
gradient the backward takes): a rank's final state is affine in its initial one, and `state_transition` gives the
linear part, so a later rank's initial state can be composed from the earlier ranks' without running them in turn.
"""
import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # transformers' chunk_size: the chunks' rounding is the reference's
# Decays below e^-45 (3e-20), and the chunk system's solution and its decayed keys (dimensionless: products of
# decays, betas and unit keys) below 1e-20, are taken as 0: 13 orders of magnitude below fp32's resolution next to
# the token's own term (decay 1) that every sum they enter holds. Kept, their products underflow to denormal numbers,
# which make the CPU's matrix products several times slower.
FORGOTTEN = -45.0
NEGLIGIBLE = 1e-20


def l2_normalized(x, eps=1e-6):
    """transformers' l2norm (fla's): x * rsqrt(sum x^2 + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(query, key, value, g, beta, document_ids=None, initial_state=None,
                           output_final_state=False):
    """(output [B, S, Hv, dv] in query's dtype, final state [B, Hv, dk, dv] fp32 or None).

    query, key [B, S, Hk, dk]; value [B, S, Hv, dv] with Hv a multiple of Hk; g (the log decay, <= 0) and beta
    [B, S, Hv]. document_ids [B, S] (None: one document a row): the state restarts where the id changes (0 on
    padding, k on a row's k-th document, as the attention's document masks read them). initial_state
    [B, Hv, dk, dv]: the state before the first token, carried into the first token's document (a caller whose
    first token starts a new document passes zeros there)."""
    if value.shape[-2] % key.shape[-2]:
        raise ValueError(f"{value.shape[-2]} value heads are not a multiple of {key.shape[-2]} key heads: each key "
                         f"head serves a whole group of value heads.")
    dtype = query.dtype
    q = l2_normalized(query.float()) * query.shape[-1] ** -0.5
    k = l2_normalized(key.float())
    segments = chunk_segments(document_ids, CHUNK_SIZE) if document_ids is not None else None
    out, final_state = ChunkedGatedDeltaRule.apply(q, k, value.float(), g.float(), beta.float(), initial_state,
                                                   segments)
    return out.to(dtype), (final_state if output_final_state else None)


def state_transition(query, key, g, beta, document_ids=None):
    """M [B, Hv, dk, dk], the linear part of the final state as a function of the initial one: for any initial state
    S0, final(S0) = M @ S0 + final(0) (zero where a document starts inside the stretch). It is the final state of the
    rule run on zero values from the identity (the values' part of the affine map drops out), differentiable as
    the rule is."""
    batch, seq, _, key_dim = key.shape
    value_heads = g.shape[-1]
    zeros = key.new_zeros(batch, seq, value_heads, key_dim, dtype=torch.float32)
    identity = torch.eye(key_dim, device=key.device).expand(batch, value_heads, key_dim, key_dim)
    return chunk_gated_delta_rule(query, key, zeros, g, beta, document_ids, identity, output_final_state=True)[1]


def chunk_segments(document_ids, chunk_size):
    """The packed documents' masks, per chunk [N, B, 1, 1, ...] (broadcast over key heads and the value heads each
    serves): (token pairs of one document [.., C, C] bool; the tokens continuing the document the chunk starts in,
    whose decays from the chunk's start stand [.., C] fp32; the tokens of the document the chunk ends in [.., C]
    fp32; whether one document spans the whole chunk from before it [..] fp32). The padding to whole chunks
    continues the last token's document."""
    batch, seq = document_ids.shape
    padded = -(-seq // chunk_size) * chunk_size
    starts = torch.zeros(batch, padded, dtype=torch.int32, device=document_ids.device)
    starts[:, 1:seq] = (document_ids[:, 1:] != document_ids[:, :-1]).to(torch.int32)
    segment = starts.cumsum(dim=1, dtype=torch.int32)  # 0: the initial state's document
    before = F.pad(segment[:, chunk_size - 1:-1:chunk_size], (1, 0))  # the segment of the token before each chunk
    segment = segment.view(batch, -1, chunk_size).transpose(0, 1)[:, :, None, None]  # [N, B, 1, 1, C]
    before = before.transpose(0, 1)[:, :, None, None, None]
    same = segment[..., :, None] == segment[..., None, :]
    carried = (segment == before).float()
    last = (segment == segment[..., -1:]).float()
    return same, carried, last, carried[..., -1]


def to_chunks(x, key_heads, chunk_size):
    """[B, S, H, d] as [N, B, Hk, H / Hk, C, d] (the sequence padded with zeros to whole chunks), contiguous."""
    batch, seq, heads, dim = x.shape
    padded = -(-seq // chunk_size) * chunk_size
    x = F.pad(x, (0, 0, 0, 0, 0, padded - seq))
    return x.view(batch, -1, chunk_size, key_heads, heads // key_heads, dim).permute(1, 0, 3, 4, 2, 5).contiguous()


def from_chunks(x, seq):
    """to_chunks' inverse: [N, B, Hk, r, C, d] as [B, S, Hk * r, d], contiguous."""
    chunks, batch, key_heads, group, chunk_size, dim = x.shape
    x = x.permute(1, 0, 4, 2, 3, 5).reshape(batch, chunks * chunk_size, key_heads * group, dim)
    return x[:, :seq].contiguous() if seq < chunks * chunk_size else x


def flat(x):
    """[N, B, Hk, r, ...] as [N, B * Hk * r, ...] (a view): the scan's batch of value heads per chunk."""
    return x.flatten(1, 3)


class ChunkedGatedDeltaRule(torch.autograd.Function):
    """The rule on normalised fp32 inputs: (q, k [B, S, Hk, dk], v [B, S, Hv, dv], g, beta [B, S, Hv], initial state
    or None, chunk_segments' masks or None) -> (output [B, S, Hv, dv], final state [B, Hv, dk, dv]), both fp32.

    The intra-chunk terms are batched over every chunk and head; only the state's two matrix products per chunk
    run in turn, forward and backward. q k^T and k k^T are computed once per key head and shared by the value heads
    it serves; the states entering each chunk are kept for the backward, as autograd would keep them."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, segments):
        batch, seq, key_heads, key_dim = k.shape
        value_heads, value_dim = v.shape[-2:]
        chunk = CHUNK_SIZE
        q, k = to_chunks(q, key_heads, chunk), to_chunks(k, key_heads, chunk)  # [N, B, Hk, 1, C, dk]
        v = to_chunks(v, key_heads, chunk)  # [N, B, Hk, r, C, dv]
        g, beta = (to_chunks(x[..., None], key_heads, chunk)[..., 0] for x in (g, beta))  # [N, B, Hk, r, C]
        cumulated = g.cumsum(dim=-1)
        decay, e, f, gamma = chunk_decays(cumulated, segments)
        key_products = k @ k.transpose(-1, -2)  # [N, B, Hk, 1, C, C], shared by the key head's value heads
        query_products = q @ k.transpose(-1, -2)
        system = key_products * decay * beta[..., None]  # its strictly lower triangle (the diagonal is taken as 1)
        identity = torch.eye(chunk, dtype=system.dtype, device=system.device)
        solve = without_negligible_(torch.linalg.solve_triangular(system, identity.expand_as(system), upper=False,
                                                                  unitriangular=True))
        u = solve @ (v * beta[..., None])
        w = without_negligible_(solve @ (k * (beta * e)[..., None]))
        states, v_new = scan_states(u, w, k * f[..., None], gamma, initial_state, (batch, value_heads, key_dim,
                                                                                   value_dim))
        chunks = cumulated.shape[0]
        entering = states[:chunks].view(*v.shape[:4], key_dim, value_dim)
        out = (q * e[..., None]) @ entering + (query_products * decay) @ v_new
        ctx.save_for_backward(q, k, v, beta, cumulated, decay, key_products, query_products, solve, u, w, states,
                              v_new, *(segments or ()))
        ctx.seq, ctx.has_initial_state = seq, initial_state is not None
        return from_chunks(out, seq), states[chunks].view(batch, value_heads, key_dim, value_dim).clone()

    @staticmethod
    def backward(ctx, grad_out, grad_final_state):
        (q, k, v, beta, cumulated, decay, key_products, query_products, solve, u, w, states, v_new,
         *segments) = ctx.saved_tensors
        seq = ctx.seq
        chunks, batch, key_heads, group, chunk, value_dim = v.shape
        key_dim = k.shape[-1]
        _, e, f, gamma = chunk_decays(cumulated, segments or None, decay=decay)
        grouped = (chunks, batch, key_heads, group)
        grad_out = to_chunks(grad_out, key_heads, chunk)
        masked_query, masked_key = q * e[..., None], k * f[..., None]
        products = query_products * decay
        grad_state = (torch.zeros_like(states[0]) if grad_final_state is None else
                      grad_final_state.reshape(states[0].shape).float())
        entering = states[:chunks].view(*grouped, key_dim, value_dim)
        # The reverse scan: the gradient of the state after each chunk, and of each chunk's new values.
        grad_after, grad_v_new = scan_gradients(products.transpose(-1, -2) @ grad_out,
                                                masked_query.transpose(-1, -2) @ grad_out, masked_key, w, gamma,
                                                grad_state)
        grad_initial_state = grad_after[-1]
        grad_after = grad_after[:chunks].view(*grouped, key_dim, value_dim)
        grad_v_new = grad_v_new.view_as(v_new)
        grad_masked_query = grad_out @ entering.transpose(-1, -2)
        grad_w = -(grad_v_new @ entering.transpose(-1, -2))
        grad_masked_key = v_new @ grad_after.transpose(-1, -2)
        grad_products = grad_out @ v_new.transpose(-1, -2)
        grad_gamma = (entering * grad_after).sum(dim=(-1, -2))
        # Through the chunk's triangular system: u = T (beta v), w = T (beta e k), T = (I + L)^-1.
        grad_v_beta = solve.transpose(-1, -2) @ grad_v_new
        grad_k_beta_e = solve.transpose(-1, -2) @ grad_w
        grad_system = -(grad_v_beta @ u.transpose(-1, -2) + grad_k_beta_e @ w.transpose(-1, -2)).tril_(-1)
        grad_system_decayed = grad_system * decay
        grad_key_products = grad_system_decayed * beta[..., None]
        grad_query_products = grad_products * decay
        grad_decay_decayed = grad_key_products * key_products + grad_query_products * query_products
        grad_decay_decayed.diagonal(dim1=-2, dim2=-1).zero_()  # a token's decay to itself is 1: no gradient to g
        key_beta_e = (grad_k_beta_e * k).sum(dim=-1)
        grad_beta = ((grad_system_decayed * key_products).sum(dim=-1) + (grad_v_beta * v).sum(dim=-1)
                     + e * key_beta_e)
        grad_e = beta * key_beta_e + (grad_masked_query * q).sum(dim=-1)
        grad_f = (grad_masked_key * k).sum(dim=-1)
        grad_key_products = grad_key_products.sum(dim=3, keepdim=True)
        grad_query_products = grad_query_products.sum(dim=3, keepdim=True)
        grad_q = (grad_masked_query * e[..., None]).sum(dim=3, keepdim=True) + grad_query_products @ k
        grad_k = ((grad_k_beta_e * (beta * e)[..., None] + grad_masked_key * f[..., None]).sum(dim=3, keepdim=True)
                  + grad_query_products.transpose(-1, -2) @ q
                  + (grad_key_products + grad_key_products.transpose(-1, -2)) @ k)
        grad_v = grad_v_beta * beta[..., None]
        # The decays are exponentials of the cumulated g: pairwise, from the chunk's start, to its end, over it.
        grad_f_f = grad_f * f
        grad_cumulated = (grad_decay_decayed.sum(dim=-1) - grad_decay_decayed.sum(dim=-2) + grad_e * e - grad_f_f)
        grad_cumulated[..., -1] += grad_f_f.sum(dim=-1) + grad_gamma * gamma
        grad_g = grad_cumulated.flip(-1).cumsum(dim=-1).flip(-1)
        return (from_chunks(grad_q, seq), from_chunks(grad_k, seq), from_chunks(grad_v, seq),
                from_chunks(grad_g[..., None], seq)[..., 0], from_chunks(grad_beta[..., None], seq)[..., 0],
                grad_initial_state.view(batch, -1, key_dim, value_dim) if ctx.has_initial_state else None, None)


def chunk_decays(cumulated, segments, decay=None):
    """(the pairwise decays [.., C, C]: exp of the cumulated g from key to query, 0 above the diagonal and between
    documents; e, f [.., C]: the decays from the chunk's start to each token and from each token to the chunk's end;
    gamma [..]: over the whole chunk), each zero where a document boundary cuts it off (chunk_segments)."""
    chunk = cumulated.shape[-1]
    if decay is None:
        allowed = torch.ones(chunk, chunk, dtype=torch.bool, device=cumulated.device).tril()
        if segments is not None:
            allowed = allowed & segments[0]
        decay = forgotten_exp((cumulated[..., :, None] - cumulated[..., None, :]).masked_fill_(~allowed, -torch.inf))
    e = forgotten_exp(cumulated)
    f = forgotten_exp(cumulated[..., -1:] - cumulated)
    gamma = forgotten_exp(cumulated[..., -1])
    if segments is not None:
        _, carried, last, whole = segments
        e, f, gamma = e * carried, f * last, gamma * whole
    return decay, e, f, gamma


def forgotten_exp(log_decay):
    """exp(log_decay), 0 below e^FORGOTTEN."""
    return log_decay.masked_fill(log_decay < FORGOTTEN, -torch.inf).exp_()


def without_negligible_(x):
    """x, its entries below NEGLIGIBLE zeroed in place."""
    return x.masked_fill_(x.abs() < NEGLIGIBLE, 0)


def scan_states(u, w, masked_key, gamma, initial_state, state_shape):
    """(the states entering each chunk and the final one [N + 1, B * Hv, dk, dv]; each chunk's new values
    [N, B, Hk, r, C, dv]), chunk after chunk: v_new = u - w S, S' = gamma S + (f k)^T v_new."""
    chunks = u.shape[0]
    batch, value_heads, key_dim, value_dim = state_shape
    states = u.new_empty(chunks + 1, batch * value_heads, key_dim, value_dim)
    if initial_state is None:
        states[0].zero_()
    else:
        states[0].copy_(initial_state.reshape(states[0].shape))
    v_new = torch.empty_like(u)
    u_, w_, key_t, gamma_ = flat(u), flat(w), flat(masked_key).transpose(-1, -2), flat(gamma)[..., None, None]
    v_new_ = flat(v_new)
    for n in range(chunks):
        torch.baddbmm(u_[n], w_[n], states[n], alpha=-1, out=v_new_[n])
        torch.baddbmm(states[n] * gamma_[n], key_t[n], v_new_[n], out=states[n + 1])
    return states, v_new


def scan_gradients(grad_out_through_products, grad_out_through_queries, masked_key, w, gamma, grad_final_state):
    """(the gradients of the state after each chunk, and of the initial state last [N + 1, B * Hv, dk, dv]; of each
    chunk's new values [N, B * Hv, C, dv]), from the last chunk back: dv_new = P^T dO + (f k) dS',
    dS = (e q)^T dO - w^T dv_new + gamma dS'."""
    chunks = w.shape[0]
    grad_after = grad_final_state.new_empty(chunks + 1, *grad_final_state.shape)
    grad_v_new = flat(torch.empty_like(grad_out_through_products))
    products_, queries_ = flat(grad_out_through_products), flat(grad_out_through_queries)
    key_, w_t, gamma_ = flat(masked_key), flat(w).transpose(-1, -2), flat(gamma)[..., None, None]
    grad_state = grad_final_state
    for n in reversed(range(chunks)):
        grad_after[n] = grad_state
        torch.baddbmm(products_[n], key_[n], grad_state, out=grad_v_new[n])
        grad_state = torch.baddbmm(torch.addcmul(queries_[n], gamma_[n], grad_state), w_t[n], grad_v_new[n], alpha=-1)
    grad_after[chunks] = grad_state
    return grad_after, grad_v_new
