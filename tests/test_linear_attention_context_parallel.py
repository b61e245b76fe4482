"""Context parallelism for linear attention (models/context_parallel.py ContextParallelDeltaRuleCore, the head
all-to-all), at the part's level on real processes (gloo): GatedDeltaNet's output and every gradient (its
parameters', its input's) under a context group of 2 and 4 equal one device's, on packed rows whose documents start
on a rank boundary and run across one (the convolution's window and the recurrent state restart at each, whichever
rank holds them), padded rows, and rows of one document without document ids; refused where the heads do not
split."""
import pytest
import torch

from models.context_parallel import ContextParallel, ContextParallelDeltaRuleCore
from models.linear_attention import DeltaRuleCore, GatedDeltaNet
from tests.distributed import spawn

SEQ = 200  # 2c chunks of 50 (c = 2) or 25 (c = 4): the rule's chunks of 64 cut across them


def rows():
    """(hidden [3, SEQ, 32], document ids [3, SEQ] or None, the output's gradient): row 0 packs documents that
    start at token 50 (a rank boundary under c = 2: rank 0's first chunk ends there) and run from 120 across 150
    (rank 1's chunk into rank 0's second) to 190, then padding; row 1 is one document then padding; row 2 packs
    documents of 1, 2 and 3 tokens at the row's start."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, SEQ, 32, generator=gen)
    ids = torch.zeros(3, SEQ, dtype=torch.long)
    ids[0, :50], ids[0, 50:120], ids[0, 120:190] = 1, 2, 3
    ids[1, :170] = 1
    ids[2, :1], ids[2, 1:3], ids[2, 3:6], ids[2, 6:] = 1, 2, 3, 4
    return hidden, ids, torch.randn(3, SEQ, 32, generator=gen)


def mixer():
    """4 key heads of 16 features serving 8 value heads of 8, a kernel of 4, random weights (decays that keep the
    state over tens of tokens, so a wrong carry across ranks shows)."""
    torch.manual_seed(1)
    layer = GatedDeltaNet(32, 4, 8, 16, 8, 4)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.linspace(0.01, 0.3, 8).log())
            elif name != "norm.weight":
                param.normal_(std=0.5 if name in ("conv1d.weight", "dt_bias") else 0.2)
    return layer


def one_device(hidden, ids, grad_out, with_ids=True):
    layer = mixer()
    leaf = hidden.clone().requires_grad_()
    out = layer(leaf, ids if with_ids else None)
    out.backward(grad_out)
    return out.detach(), leaf.grad, {name: param.grad for name, param in layer.named_parameters()}


def context_worker(rank, size):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=size)
    context = ContextParallel(size, rank, dist.group.WORLD)
    hidden, ids, grad_out = rows()
    for with_ids in (True, False):
        ref_out, ref_input_grad, ref_grads = one_device(hidden, ids, grad_out, with_ids)
        layer = mixer()
        layer.core = ContextParallelDeltaRuleCore(layer.core, context)
        leaf = context.local_tokens(hidden).clone().requires_grad_()
        out = layer(leaf, context.local_tokens(ids) if with_ids else None)
        out.backward(context.local_tokens(grad_out))
        torch.testing.assert_close(out, context.local_tokens(ref_out), rtol=0, atol=2e-5)
        torch.testing.assert_close(leaf.grad, context.local_tokens(ref_input_grad), rtol=0, atol=2e-5)
        for name, param in layer.named_parameters():
            summed = param.grad.clone()  # each rank's share: its tokens' projections, its heads' convolution
            dist.all_reduce(summed)
            scale = ref_grads[name].abs().max()
            assert ((summed - ref_grads[name]).abs().max() / scale).item() < 1e-5, (name, with_ids)
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_gated_delta_net_under_context_parallelism_equals_one_device(size):
    spawn(context_worker, size, size, timeout=300)


def test_the_reference_tells_a_state_restarted_at_the_rank_boundary_apart():
    """What a per-rank restart (plain Ulysses-less splitting: each rank's stretch alone) would give differs from
    the whole row past the tolerance: the test above can fail."""
    hidden, _, _ = rows()
    layer = mixer()
    whole = layer(hidden[:1])
    split = torch.cat([layer(hidden[:1, :100]), layer(hidden[:1, 100:])], dim=1)
    assert (whole - split)[:, 100:].abs().max() > 1e-3


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"^linear_num_key_heads=2 does not split over context_parallel_size=4"):
        ContextParallelDeltaRuleCore(DeltaRuleCore(2, 8, 16, 8), ContextParallel(4, 0))


# The hybrids on the pipeline under context parallelism, on 4 processes: {name: (tiny model, stages, tensor
# parallel, context parallel, options)}, as tests/test_context_parallel.py's CASES.
HYBRID_CASES = {
    "qwen3_5_cp2_x_2replicas": ("qwen3_5", 1, 1, 2, {}),
    "qwen3_5_tied_2stages_x_cp2": ("qwen3_5_tied", 2, 1, 2, {}),  # the tied embedding across the stages
}


@pytest.mark.slow
def test_hybrids_under_context_parallelism_equal_transformers(tiny_hybrid_checkpoints, tmp_path):
    """Qwen3.5 (linear attention, gated full attention) on the pipeline with context_parallel_size=2: the eval loss
    (the trainer's evaluate), the training loss and every gradient on each rank equal transformers' on each packed
    document alone (its torch path cannot keep them apart) and on full rows (eval within 1e-5, gradients 1e-4)."""
    from tests.test_context_parallel import assert_context_parity
    assert_context_parity(tiny_hybrid_checkpoints, tmp_path, HYBRID_CASES)
