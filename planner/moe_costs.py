"""What a mixture-of-experts layer costs beyond a dense one, for the cost model (planner/stage_costs.py): the
activations its MoE block keeps for backward, and those of attention with sinks (GPT-OSS), which always runs the
eager formula. Each figure was checked against autograd's saved tensors (tests/test_moe.py)."""
from planner.training_state import FP32_BYTES

INT64_BYTES = 8


def moe_saved_bytes(moe, tokens, hidden, act):
    """What an MoE block (models/moe.py) keeps for backward on the `tokens` it routes (its residual share), besides
    the dense layer's attention and norms (its shared expert counts as the dense MLP): per routed choice
    (tokens x top_k), the token's copy, its gate/up and down outputs and the SwiGLU's intermediates (GPT-OSS's
    clamped one keeps three more and each row's expert), the sort's two int64 indices (its order, each row's token)
    and the routing weight (fp32 in Mixtral); per token, the router's softmax (fp32) and top-k indices, with
    norm_topk_prob the top-k and their sum, GPT-OSS's softmax of the top-k instead, and with the load-balancing
    loss the softmax in the activation dtype and the fp32 mask; the grouped GEMM's two int32 offsets. Checked
    against autograd's saved tensors (tests/test_moe.py)."""
    routed = tokens * moe.top_k
    swiglu = 7 if moe.swiglu_limit is not None else 4  # intermediate-sized tensors per choice, gate/up's two included
    weight_bytes = act if moe.weights_in_logits_dtype and not moe.sigmoid_routing else FP32_BYTES
    per_choice = act * (2 * hidden + swiglu * moe.expert_size) + 2 * INT64_BYTES + weight_bytes \
        + (INT64_BYTES if moe.expert_bias else 0)
    if moe.softmax_after_topk:
        router = moe.top_k * (INT64_BYTES + act)
    else:  # DeepSeek-V3's: its sigmoid scores, and below fp32 the fp32 copy of its input
        router = FP32_BYTES * moe.num_experts + INT64_BYTES * moe.top_k + \
            (FP32_BYTES * (moe.top_k + 1) if moe.norm_topk_prob else 0) + \
            (FP32_BYTES * hidden if moe.sigmoid_routing and act != FP32_BYTES else 0)
    aux = act * moe.num_experts + FP32_BYTES if moe.aux_loss else 0
    # Qwen2-MoE's shared expert gate's sigmoid and the shared output
    shared_gate = act * (hidden + 1) if moe.shared_expert_size and moe.shared_expert_gated else 0
    return routed * per_choice + tokens * (router + aux + shared_gate) + 2 * 4 * moe.num_experts


def moe_weight_grad_bytes(moe, tokens, hidden, act, input_kept):
    """What a micro-batch waiting for its W (zero-bubble schedules, models/weight_grads.py) keeps of an MoE block on
    the `tokens` it routes: per routed choice the experts' inputs (the token's copy and the SwiGLU's output) and
    output gradients (gate/up's and down's), and with expert biases each row's expert; per token the router's
    logit gradient (fp32 in DeepSeek's sigmoid router) and its input, the block's (input_kept: already counted, as
    the shared expert's input) or DeepSeek's fp32 copy of it below fp32, Qwen2-MoE's shared gate's gradient; the
    grouped GEMM's two offsets."""
    routed = tokens * moe.top_k
    experts = routed * (act * (2 * hidden + 3 * moe.expert_size) + (INT64_BYTES if moe.expert_bias else 0)) \
        + 2 * 4 * moe.num_experts
    copied = moe.sigmoid_routing and act != FP32_BYTES
    router_input = FP32_BYTES * hidden if copied else 0 if input_kept else act * hidden
    logits = (FP32_BYTES if moe.sigmoid_routing else act) * moe.num_experts
    shared_gate = act if moe.shared_expert_size and moe.shared_expert_gated else 0
    return experts + tokens * (router_input + logits + shared_gate)


def eager_attention_extra_bytes(workload, heads, q_width, kv_width, act):
    """What attention with sinks (GPT-OSS, always the eager formula: models/attention_kernels.py) keeps beyond SDPA's: the keys
    and values repeated for every query head, and the scores with the sink column, their maximum and their
    softmax, instead of SDPA's log-sum-exp."""
    scores = workload.micro_batch_size * heads * workload.seq_length * (workload.seq_length + 1)
    return (act * (2 * workload.tokens * (q_width - kv_width) + 2 * scores
                   + workload.micro_batch_size * heads * workload.seq_length)
            - FP32_BYTES * workload.tokens * heads)
