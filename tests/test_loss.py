"""The chunked LM head + loss (models/loss.py) against the full-logits head it replaces: the same losses and
gradients through the engine (1 stage, 2 stages, tensor parallel 2, tied and untied), its zero-bubble B and its
evaluation path. Against transformers, every parity test runs it already (tests/parity_worker.py CHUNK_TOKENS)."""
import glob
import json

import pytest
import torch
from transformers import LlamaConfig

from models.pipeline_layers import LMHeadPipe
from models.loss import CausalLMLoss
from models.tensor_parallel import TensorParallel
from models.weight_grads import WeightGradQueue
from tests import parity_worker
from tests.distributed import spawn

MICRO_BATCH, GAS, SEQ = 2, 2, 16


@pytest.mark.parametrize("num_stages,world_size,tensor_parallel", [(1, 1, 1), (2, 2, 1), (1, 2, 2)],
                         ids=["1stage", "2stages", "tp2"])
@pytest.mark.slow
def test_chunked_loss_equals_the_logits_head(tiny_checkpoints, tmp_path, num_stages, world_size, tensor_parallel):
    cases = [dict(name=f"{model}-{chunk}", hf_dir=tiny_checkpoints[model][0], ds_dir=tiny_checkpoints[model][1],
                  loss_chunk_tokens=chunk, save_grads=True)
             for model in ("llama3", "tied") for chunk in (0, parity_worker.CHUNK_TOKENS)]
    spawn(parity_worker.run, world_size, cases, num_stages, MICRO_BATCH, GAS, SEQ, str(tmp_path), tensor_parallel)
    for path in sorted(glob.glob(str(tmp_path / "rank*.json"))):
        rank = path[-len("0.json"):-len(".json")]
        results = json.load(open(path))
        for model in ("llama3", "tied"):
            logits, chunked = results[f"{model}-0"], results[f"{model}-{parity_worker.CHUNK_TOKENS}"]
            assert chunked["losses"] == pytest.approx(logits["losses"], abs=1e-6, rel=0), model
            assert chunked["mean_loss"] == pytest.approx(logits["mean_loss"], abs=1e-6, rel=0), model
            grads = {chunk: torch.load(tmp_path / f"{model}-{chunk}-rank{rank}.pt")
                     for chunk in (0, parity_worker.CHUNK_TOKENS)}
            for name, reference in grads[0].items():
                error = (grads[parity_worker.CHUNK_TOKENS][name] - reference).abs().max().item()
                assert error <= 1e-5, f"{model} {name}: {error}"


def head_and_batch(dtype, chunk, parallel):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, vocab_size=101, num_attention_heads=4, num_hidden_layers=1,
                         intermediate_size=64)
    head = LMHeadPipe(config, parallel, chunked_loss=chunk > 0).to(dtype)
    hidden = torch.randn(2, 9, 32, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 101, (2, 9))
    labels[0, :4] = -100
    return head, hidden, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_bubble_leaves_no_w_for_the_chunked_head(dtype):
    """Under zero_bubble the head's weight gradient, computed in the forward pass with its input's, arrives with B:
    nothing waits for W (which would have to project every chunk again), and both equal, bit for bit, the gradients
    without the schedule."""
    head, hidden, labels = head_and_batch(dtype, 4, TensorParallel())
    CausalLMLoss(head.parallel, 4)(head(hidden), labels).backward(torch.tensor(3.0))
    expected_weight, expected_input = head.weight.grad, hidden.grad
    deferring = TensorParallel()
    deferring.weight_grads = WeightGradQueue()
    head.parallel, head.weight.grad, hidden.grad = deferring, None, None
    loss = CausalLMLoss(deferring, 4)(head(hidden), labels)
    with deferring.weight_grads.defer():
        loss.backward(torch.tensor(3.0))
    assert torch.equal(head.weight.grad, expected_weight) and torch.equal(hidden.grad, expected_input)
    deferring.weight_grads.run_oldest()  # the micro-batch's W: no work of the head's
    assert torch.equal(head.weight.grad, expected_weight)


def test_evaluation_keeps_no_gradient_and_equals_the_logits_loss():
    head, hidden, labels = head_and_batch(torch.float32, 4, TensorParallel())
    logits_head, _, _ = head_and_batch(torch.float32, 0, TensorParallel())
    with torch.no_grad():
        loss = CausalLMLoss(chunk_tokens=4)(head(hidden), labels)
        reference = CausalLMLoss()(logits_head(hidden), labels)
    assert loss.grad_fn is None and abs(loss.item() - reference.item()) <= 1e-6


def test_a_bf16_head_sums_its_chunks_weight_gradients_in_fp32():
    """The chunked head's weight gradient over 64 chunks, against the fp64 logits head's: summed in fp32 (the run's
    grad_accum_dtype=fp32) it keeps only each chunk's bf16 rounding; summed in bf16 every addition rounds again."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, vocab_size=512, num_attention_heads=4, num_hidden_layers=1,
                         intermediate_size=128)
    head = LMHeadPipe(config, TensorParallel(), chunked_loss=True).to(torch.bfloat16)
    hidden = torch.randn(2, 256, 64, dtype=torch.bfloat16)
    labels = torch.randint(0, 512, (2, 256))
    reference = LMHeadPipe(config, TensorParallel()).to(torch.float64)
    reference.weight.data.copy_(head.weight)
    CausalLMLoss()(reference(hidden.double()), labels).backward()
    errors = {}
    for grad_sum_dtype in (torch.float32, torch.bfloat16):
        head.weight.grad = None
        CausalLMLoss(chunk_tokens=8, grad_sum_dtype=grad_sum_dtype)(head(hidden), labels).backward()
        assert head.weight.grad.dtype == torch.bfloat16
        errors[grad_sum_dtype] = float((head.weight.grad.double() - reference.weight.grad).norm()
                                       / reference.weight.grad.norm())
    assert errors[torch.float32] < 0.5 * errors[torch.bfloat16], errors


def test_evaluation_keeps_the_load_balancing_terms_and_training_does_not():
    """An MoE model's loss adds router_aux_loss_coef x its load-balancing loss. A forward without gradient
    (evaluation's) keeps that term for take_aux_terms, from which evaluation's perplexity is of the cross-entropy
    alone; a training forward keeps none."""
    from models.router_loss import LoadBalancingLoss
    from tests.tiny_models import MOE_CONFIGS
    config = MOE_CONFIGS["mixtral"]()
    experts, generator = config.num_local_experts, torch.Generator().manual_seed(0)
    labels = torch.randint(0, config.vocab_size, (2, 8), generator=generator)
    counts = torch.randint(1, 5, (config.num_hidden_layers, experts), generator=generator)
    logits = [torch.randn(2, 8, config.vocab_size, generator=generator) for _ in range(3)]
    sums = [torch.rand(experts, generator=generator) for _ in range(3)]
    loss_fn = CausalLMLoss(router=LoadBalancingLoss(config))
    loss_fn((logits[0].requires_grad_(), counts, sums[0].requires_grad_()), labels).backward()
    assert loss_fn.take_aux_terms() == []
    with torch.no_grad():
        losses = [loss_fn((logits[i], counts, sums[i]), labels) for i in (1, 2)]
    terms = loss_fn.take_aux_terms()
    assert len(terms) == 2 and all(term > 0.01 for term in terms)
    for loss, term, i in zip(losses, terms, (1, 2)):
        assert torch.allclose(loss - term, CausalLMLoss()(logits[i], labels), atol=1e-6)
    assert loss_fn.take_aux_terms() == []


@pytest.mark.parametrize("chunk_tokens", [0, 5], ids=["logits", "chunked"])
def test_soft_capped_loss_and_gradients_equal_autograd(chunk_tokens):
    """Gemma's final soft cap inside the loss: the chunked path (each chunk's logits capped, their gradient times
    the cap's derivative) and the logits path, against autograd through cap * tanh(logits / cap), fp32."""
    from models.gemma3 import soft_cap
    torch.manual_seed(0)
    hidden = (torch.randn(2, 9, 16) * 4).requires_grad_()
    weight = torch.randn(40, 16).requires_grad_()
    labels = torch.randint(0, 40, (2, 9))
    labels[1, 6:] = -100
    logits = soft_cap(hidden @ weight.t(), 3.0)
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                  ignore_index=-100)
    expected = torch.autograd.grad(reference, (hidden, weight))
    loss_fn = CausalLMLoss(chunk_tokens=chunk_tokens, logit_cap=3.0)
    outputs = (hidden, weight) if chunk_tokens else hidden @ weight.t()
    loss = loss_fn(outputs, labels)
    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)
    for mine, theirs in zip(torch.autograd.grad(loss, (hidden, weight)), expected):
        assert (mine - theirs).abs().max() < 1e-6
    uncapped = CausalLMLoss(chunk_tokens=chunk_tokens)(outputs, labels)
    assert abs(uncapped.item() - reference.item()) > 1e-2  # the cap changes the loss: the test can fail


def test_soft_capped_sequence_log_probs_and_continuation_scores_equal_autograd():
    """DPO's response log-probabilities and lm-eval's continuation scores soft-cap their logits as the loss does."""
    from models.gemma3 import soft_cap
    from models.loss import continuation_scores, sequence_log_probs
    from models.tensor_parallel import NO_TENSOR_PARALLEL
    torch.manual_seed(1)
    hidden = (torch.randn(4 * 6, 16) * 4).requires_grad_()
    weight = torch.randn(40, 16).requires_grad_()
    labels = torch.randint(0, 40, (4 * 6,))
    labels[:3] = -100
    log_probs = torch.log_softmax(soft_cap(hidden @ weight.t(), 3.0), dim=-1)
    picked = log_probs.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * (labels != -100)
    reference = picked.view(4, 6).sum(1)
    mine = sequence_log_probs(hidden, weight, labels, 4, NO_TENSOR_PARALLEL, 5, logit_cap=3.0)
    assert (mine - reference).abs().max() < 1e-5
    scale = torch.randn(4)
    for ours, theirs in zip(torch.autograd.grad((mine * scale).sum(), (hidden, weight)),
                            torch.autograd.grad((reference * scale).sum(), (hidden, weight))):
        assert (ours - theirs).abs().max() < 1e-5
    for outputs, chunk in (((hidden.detach(), weight.detach()), 5), (hidden.detach() @ weight.detach().t(), 0)):
        scores = continuation_scores(outputs, labels, 4, NO_TENSOR_PARALLEL, chunk, logit_cap=3.0)
        assert (scores[:, 0] - reference.detach()).abs().max() < 1e-5
