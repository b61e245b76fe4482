"""No host sync per micro-batch or per chunk on the training path: a stage's layers and the chunked losses (next
token, DPO) run forward and backward over several micro-batches of several chunks without one op that reads a
device value on the host (tests/host_syncs.py), whatever the rows hold; the attention masks are the run's choice
(data/collator.py row_layout), not read from each micro-batch. Under expert parallelism a sparse layer reads its
all-to-all's split sizes once per micro-batch, and nothing else syncs. bench/host_syncs.py counts a whole train_batch
(on CUDA with torch.cuda.set_sync_debug_mode)."""
import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from data.collator import collate, collate_causal_lm, collate_preference, row_layout
from models.attention import StageAttentionInputs
from models.loss import CausalLMLoss, with_step_divisor
from models.pipeline_layers import DecoderLayerPipe, EmbeddingPipe, FinalNormPipe, LMHeadPipe, StagePlan
from models.preference import PreferenceLoss, PreferenceSettings
from tests.host_syncs import HostSyncs
from tests.tiny_models import COMMON

SEQ, CHUNK_TOKENS = 16, 5  # 2 rows x 16 tokens: 7 chunks (6 for a DPO micro-batch's 4 rows x 15 scored positions)


def stage(layout):
    torch.manual_seed(0)
    config = LlamaConfig(**COMMON, num_key_value_heads=2)
    inputs = StageAttentionInputs(config, row_layout=layout)
    return [EmbeddingPipe(config), DecoderLayerPipe(config, inputs), DecoderLayerPipe(config, inputs),
            FinalNormPipe(config), LMHeadPipe(config, chunked_loss=True)]


def rows(count, packed):
    """Rows of random tokens, shorter than SEQ (padding); packed: each of three documents."""
    generator = torch.Generator().manual_seed(count)
    out = []
    for length in torch.randint(6, SEQ, (count,), generator=generator).tolist():
        ids = torch.randint(0, 96, (length,), generator=generator).tolist()
        out.append({"input_ids": ids, "labels": ids, **({"lengths": [2, 3, length - 5]} if packed else {})})
    return out


def syncs_of_micro_batches(layers, loss_fn, micro_batches):
    divisor = torch.tensor(7.0)  # a training step's (training/token_mean.py), beside each micro-batch's labels
    with HostSyncs() as syncs:
        for inputs, labels in micro_batches:
            x = inputs
            for layer in layers:
                x = layer(x)
            loss_fn(x, with_step_divisor(labels, divisor)).backward()
    assert all(p.grad is not None for layer in layers for p in layer.parameters())
    return syncs.ops


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_next_token_loss_takes_no_host_sync(layout):
    examples = rows(6, layout == "packed")
    batches = [collate_causal_lm(examples[k:k + 2], SEQ, pad_id=0) for k in range(0, 6, 2)]
    assert syncs_of_micro_batches(stage(layout), CausalLMLoss(chunk_tokens=CHUNK_TOKENS), batches) == []


def test_steps_of_changing_length_take_no_host_sync():
    """data.length_buckets: micro-batches padded to 8, then 16, then 12 positions (the collator picks the width
    from the rows' lengths on the host, data/length_buckets.py)."""
    bounds = (8, 12, SEQ)
    batches = [collate(rows_of_lengths(lengths), SEQ, pad_id=0, bounds=bounds)
               for lengths in ((3, 8), (9, 16), (5, 11))]
    assert [inputs.shape[1] for (inputs, _, _), _ in batches] == [8, 16, 12]
    assert syncs_of_micro_batches(stage("padded"), CausalLMLoss(chunk_tokens=CHUNK_TOKENS), batches) == []


def rows_of_lengths(lengths):
    return [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in lengths]


def test_dpo_loss_takes_no_host_sync():
    pairs = [{"chosen_input_ids": r["input_ids"], "chosen_labels": [-100] * 3 + r["labels"][3:],
              "rejected_input_ids": r["input_ids"][::-1], "rejected_labels": [-100] * 3 + r["labels"][3:],
              "ref_chosen_logps": -20.0, "ref_rejected_logps": -21.0} for r in rows(6, packed=False)]
    batches = [collate_preference(pairs[k:k + 2], SEQ, pad_id=0) for k in range(0, 6, 2)]
    loss_fn = PreferenceLoss(PreferenceSettings("dpo"), chunk_tokens=CHUNK_TOKENS)
    assert syncs_of_micro_batches(stage("padded"), loss_fn, batches) == []
    assert loss_fn.take_metrics()["rewards/accuracies"] in (0.0, 1 / 3, 2 / 3, 1.0)  # read once, at logging


def test_the_recorder_sees_the_syncs_the_old_path_took():
    """What the check above would have caught: a boolean of a device tensor, boolean-mask indexing, nonzero; and
    tolist (training/token_mean.py reads a step's totals with it, once per step)."""
    x = torch.arange(6.0)
    with HostSyncs() as syncs:
        bool((x > 1).all())
        x[x > 2].sum()
        (x > 3).nonzero()
        x.masked_fill(x > 2, 0).sum()  # none
        x[:2].tolist()
    assert syncs.ops == ["aten._local_scalar_dense.default", "aten.index.Tensor", "aten.nonzero.default",
                         "Tensor.tolist"]
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and len(syncs.ops) == 4  # unwrapped after the block


def test_the_run_decides_the_attention_masks_from_its_rows():
    """Packed rows take a mask per document; one-document rows none (causal attention), but under context
    parallelism padded rows' halves do (models/attention.py StageAttentionInputs)."""
    def data(**keys):
        return SimpleNamespace(**{"packing": False, "document_isolation": False, "format": "chat", **keys})
    assert [row_layout(data(**keys)) for keys in (
        {}, {"format": "preference"}, {"packing": True}, {"format": "text"},
        {"format": "text", "document_isolation": True}, {"format": "indexed"},
        {"format": "indexed", "document_isolation": True})] == [
        "padded", "padded", "packed", "full", "packed", "full", "packed"]
    config = LlamaConfig(**COMMON)
    (inputs, document_ids, positions), _ = collate_causal_lm(rows(2, packed=False), SEQ, pad_id=0)
    hidden = torch.zeros(2, SEQ, COMMON["hidden_size"])
    masks = {layout: StageAttentionInputs(config, row_layout=layout)(hidden, document_ids, positions)[2]
             for layout in ("padded", "full", "packed")}
    assert masks["padded"] is None and masks["full"] is None
    assert masks["packed"].shape == (2, 1, SEQ, SEQ)
    with pytest.raises(ValueError, match="row_layout='mixed' is not one of packed, padded, full"):
        StageAttentionInputs(config, row_layout="mixed")


EXPERT_PARALLEL_FAMILIES = ("qwen2_moe", "gpt_oss")  # a shared expert beside the routed ones; experts' biases


def expert_parallel_syncs(rank, out_dir):
    """One rank of expert parallelism 2 (tests/test_moe.py's stage, its experts split over the two): for each family,
    the host syncs of three padded micro-batches, forward and backward."""
    from cluster.distributed import init_distributed
    from deepspeed_internals.registry import PipeDataParallelTopology
    from models.expert_parallel import build_expert_parallel
    from models.router_loss import LoadBalancingLoss
    from tests.tiny_models import MOE_CONFIGS
    init_distributed(timeout_minutes=2)
    experts = build_expert_parallel(PipeDataParallelTopology(num_pp=1, num_dp=2), 2)
    examples = rows(6 + rank, packed=False)  # other tokens on each rank
    batches = [collate_causal_lm(examples[k:k + 2], SEQ, pad_id=0) for k in range(0, 6, 2)]
    syncs = {}
    for family in EXPERT_PARALLEL_FAMILIES:
        config = MOE_CONFIGS[family]()
        inputs = StageAttentionInputs(config, row_layout="padded")
        layers = [EmbeddingPipe(config), *[DecoderLayerPipe(config, inputs, i, StagePlan(experts=experts))
                                           for i in range(config.num_hidden_layers)],
                  FinalNormPipe(config), LMHeadPipe(config, chunked_loss=True)]
        loss_fn = CausalLMLoss(chunk_tokens=5, router=LoadBalancingLoss(config))
        syncs[family] = syncs_of_micro_batches(layers, loss_fn, batches)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(syncs, f)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_an_expert_parallel_stage_takes_one_host_sync_per_sparse_layer_and_micro_batch(tmp_path):
    """The dispatch reads the all-to-all's split sizes on the host once per sparse layer and micro-batch (forward;
    backward reuses them), and nothing else does: the grouped GEMM takes them as they are."""
    from models.architecture import architecture_of
    from tests.distributed import spawn
    from tests.tiny_models import MOE_CONFIGS
    spawn(expert_parallel_syncs, 2, str(tmp_path))
    for rank in range(2):
        syncs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for family in EXPERT_PARALLEL_FAMILIES:
            sparse = sum(architecture_of(MOE_CONFIGS[family]()).sparse_layers)
            assert syncs[family] == ["Tensor.tolist"] * sparse * 3, family
