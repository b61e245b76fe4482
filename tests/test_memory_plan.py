"""The plan_only memory planner from a run config (fast: nothing of model size is built)."""
import os

import pytest
from omegaconf import open_dict

from models.partition import DECODER, EMBEDDING, HEAD, NORM
from checkpoints.background_save import agreed_async_save, snapshot_room_error, snapshot_shortfall
from planner.memory_plan import HOST_PROCESS_BYTES, format_memory_plan, host_memory_plan, memory_plan, plan_fits, \
    print_memory_plan, snapshot_bytes_of_ranks
from planner.stage_costs import LayerCosts
from tests.conftest import ROOT
from tests.helpers import compose_config
from tests.tiny_models import make_tiny_model
from errors import ConfigError
from training.run_spec import load_plan_model_config, plan_spec, plan_world_size

GIB = 2 ** 30


def run_config(name, *overrides):
    return compose_config(["plan_only=true", *overrides], name)


def test_llama_65b_without_offload_does_not_fit_two_nodes_of_eight_80gb_devices(capsys):
    cfg = run_config("llama_65b", "offload_optimizer=none")
    rows = print_memory_plan(plan_spec(cfg, 16))
    printed = capsys.readouterr().out
    assert len(rows) == 8 and "8 stages x 2 data-parallel" in printed
    assert sum(row["parameters"] for row in rows) == pytest.approx(65.3e9, rel=0.01)
    for row in rows:
        backward = row["gradients_bytes"] + row["activation_checkpointed_bytes"]
        assert row["memory_bytes"] == (row["weights_bytes"] + row["optimizer_bytes"] + row["buffer_bytes"]
                                       + max(backward, row["step_bytes"]))
        assert row["activation_full_bytes"] > row["activation_checkpointed_bytes"]
        # bf16 weights; gradients summed in fp32 by DeepSpeed's bf16 optimizer beside the bf16 .grad (2 + 4
        # bytes); fp32 master and Adam moments sharded over the 2 data-parallel ranks.
        assert row["weights_bytes"] == 2 * row["parameters"] and row["gradients_bytes"] == 6 * row["parameters"]
        assert row["optimizer_bytes"] == 6 * row["parameters"]
        assert row["buffer_bytes"] == 0  # the bf16 optimizer has no ZeRO reduce buckets
    # Checkpointing keeps one hidden state per layer instead of every intermediate.
    assert rows[0]["activation_full_bytes"] > 10 * rows[0]["activation_checkpointed_bytes"]
    # 8 billion parameters a stage at 14 bytes each do not fit 80 GiB; the verdict says so.
    assert not any(row["fits"] for row in rows) and "does NOT fit in 80 GiB" in printed


def test_llama_65b_as_shipped_offloads_the_optimizer_and_fits_gpu_and_host(capsys):
    cfg = run_config("llama_65b")
    model_config = load_plan_model_config(cfg)
    spec = plan_spec(cfg, 16)
    rows = print_memory_plan(spec)
    printed = capsys.readouterr().out
    largest_tensor = model_config.vocab_size * model_config.hidden_size * 2  # the embedding's bf16 staging buffer
    for row in rows:
        assert row["optimizer_bytes"] == 0 and row["fits"]
        # fp32 master, its fp32 gradient, Adam's two moments and a bf16 copy (18 bytes) over 2 data-parallel ranks.
        assert row["host_bytes"] == 9 * row["parameters"] + largest_tensor
        # ZeRO-1's two reduce buckets of the fp32 sums (grad_accum), the bf16 staging buffer
        assert row["buffer_bytes"] == 2 * 500_000_000 * 4 + largest_tensor
        assert row["gradients_bytes"] == 4 * row["parameters"]  # each .grad moved into its fp32 grad_accum
        assert row["step_bytes"] == row["gradients_bytes"] + 8 * (largest_tensor // 2 if row["stage"] in (0, 7)
                                                                   else 8192 * 22016)  # fp64 norm of one grad
    # Ranks 0-7 (stages 0-3 x 2 replicas) on node 0, 8-15 on node 1.
    nodes = host_memory_plan(spec, rows)
    # a save's host copies: each rank's largest file, a decoder layer's fp32 master and Adam moments
    from models.partition import layer_parameter_counts
    assert all(row["save_host_bytes"] == 12 * layer_parameter_counts(model_config)[1] for row in rows)
    assert nodes == [2 * sum(row["host_bytes"] + row["save_host_bytes"] for row in rows[start:start + 4])
                     + 8 * HOST_PROCESS_BYTES
                     for start in (0, 4)]
    assert "fits in 80 GiB per device" in printed and "fits in 1024 GiB per node" in printed
    assert "does NOT" not in printed and plan_fits(spec, rows, nodes)
    # Half the host memory is not enough; the verdict says so.
    small = run_config("llama_65b", "host_memory_gb=512")
    capsys.readouterr()
    small_spec = plan_spec(small, 16)
    rows = print_memory_plan(small_spec)
    assert "does NOT fit in 512 GiB per node" in capsys.readouterr().out
    assert not plan_fits(small_spec, rows, nodes)


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "conf"))
                                        if f.endswith(".yaml") and f != "base.yaml"))
def test_every_shipped_config_fits_the_hardware_it_names(name, demo_model):
    # tiny plans the model scripts/make_tiny_llama.py makes; the others carry their published sizes.
    cfg = run_config(name, *([f"model_name_or_path={demo_model['hf']}"] if name == "tiny" else []))
    world_size = plan_world_size(cfg)
    spec = plan_spec(cfg, world_size)
    rows = memory_plan(spec)
    assert plan_fits(spec, rows, host_memory_plan(spec, rows)), format_memory_plan(spec, rows)


@pytest.mark.parametrize("value", ["nvme", "gpu"])
def test_unknown_offload_device_is_a_clear_error(value):
    cfg = run_config("llama_65b", f"offload_optimizer={value}")
    with pytest.raises(ConfigError, match=f"offload_optimizer '{value}' is not one of \\('none', 'cpu'\\)"):
        memory_plan(plan_spec(cfg, 16))


def test_more_stages_or_memory_make_it_fit():
    cfg = run_config("llama_65b", "num_stages=16", "offload_optimizer=none")
    rows = memory_plan(plan_spec(cfg, 32))
    assert all(row["fits"] for row in rows)
    assert max(row["memory_bytes"] for row in rows) < 80 * GIB


def test_first_stage_holds_the_most_micro_batches_without_checkpointing():
    cfg = run_config("llama_7b", "activation_checkpoint_interval=0")
    rows = memory_plan(plan_spec(cfg, 4))
    assert [row["in_flight"] for row in rows] == [4, 3, 2, 1]
    middle = rows[1:-1]
    assert middle[0]["activation_full_bytes"] > middle[1]["activation_full_bytes"]
    assert all(row["activation_bytes"] == row["activation_full_bytes"] for row in rows)


@pytest.mark.parametrize("partition", ["[8,8,8,8]", "[2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2]"])
def test_zero_0_with_data_parallelism_plans_the_gradient_allreduce_copy(partition):
    """Without ZeRO, DeepSpeed's pipeline all-reduces each stage's gradients through flat copies of 500M elements,
    overfilled by the tensor that crosses the limit: 4 stages copy that much, 16 stages (400M parameters in the
    middle) their whole gradient. One data-parallel rank skips the all-reduce (training/loop.py): no copy."""
    cfg = run_config("llama_7b", "precision=fp32", "zero_stage=0", f"partition={partition}",
                     f"num_stages={partition.count(',') + 1}")
    config = load_plan_model_config(cfg)
    stages = cfg.num_stages
    alone = memory_plan(plan_spec(cfg, stages))
    replicated = memory_plan(plan_spec(cfg, 2 * stages))
    for stage, (one, two) in enumerate(zip(alone, replicated)):
        parameters = one["parameters"]
        assert two["parameters"] == parameters and one["step_bytes"] < parameters * 4 * 2
        largest = (config.vocab_size if stage in (0, stages - 1) else config.intermediate_size) * config.hidden_size
        copy = min(parameters, 500_000_000 + largest)
        assert two["step_bytes"] == 4 * (parameters + copy)
    over_the_limit = [row["parameters"] > 500_000_000 for row in replicated]
    assert over_the_limit == ([True] * 4 if stages == 4 else [True] + [False] * 14 + [True])


def test_zero_bubble_adds_micro_batches_waiting_for_weight_gradients():
    """ZB-H1 holds s micro-batches back for W on stage s: the same partition plans s weight-gradient sets more."""
    # The logits head keeps the same per micro-batch under both schedules (the chunked loss's differs: its own test).
    overrides = ("activation_checkpoint_interval=0", "partition=[8,8,8,8]", "loss_impl=logits")
    one_f_one_b = run_config("llama_7b", *overrides)
    zero_bubble = run_config("llama_7b", *overrides, "pipeline_schedule=zero_bubble")
    model_config = load_plan_model_config(one_f_one_b)
    rows_1f1b = memory_plan(plan_spec(one_f_one_b, 4))
    spec = plan_spec(zero_bubble, 4)
    workload, rows = spec.workload, memory_plan(spec)
    assert [row["in_flight"] for row in rows] == [row["in_flight"] for row in rows_1f1b] == [4, 3, 2, 1]
    assert [row["waiting_for_weight_grads"] for row in rows] == [0, 1, 2, 3]
    layers = LayerCosts(model_config, workload)
    stage_kinds = ([EMBEDDING] + [DECODER] * 8, [DECODER] * 8, [DECODER] * 8, [DECODER] * 8 + [NORM, HEAD])
    for row, reference, kinds in zip(rows, rows_1f1b, stage_kinds):
        waiting = row["waiting_for_weight_grads"] * sum(layers.weight_grad_bytes[kind] for kind in kinds)
        assert row["activation_bytes"] - reference["activation_bytes"] == waiting
    assert "zero-bubble schedule" in format_memory_plan(spec, rows)
    capped = run_config("llama_7b", *overrides, "pipeline_schedule=zero_bubble", "zero_bubble_max_waiting=1")
    capped_spec = plan_spec(capped, 4)
    rows = memory_plan(capped_spec)
    assert [row["waiting_for_weight_grads"] for row in rows] == [0, 1, 1, 1]
    assert "zero-bubble schedule (at most 1 micro-batches waiting for W)" in format_memory_plan(capped_spec, rows)


def test_llama3_70b_as_shipped_does_not_fit_under_zero_bubble(capsys):
    """With checkpointing every layer, a micro-batch waiting for W keeps far more than its checkpoints: no split
    keeps every stage in the 80 GB devices that 1F1B fits in (`balanced` takes the one least over), and the plan
    says so."""
    cfg = run_config("llama3_70b", "pipeline_schedule=zero_bubble")
    rows = print_memory_plan(plan_spec(cfg, plan_world_size(cfg)))
    out = capsys.readouterr().out
    assert "does NOT fit in 80 GiB per device" in out
    assert not all(row["fits"] for row in rows) and max(row["memory_bytes"] for row in rows) < 104 * GIB
    # ... and names the caps that would (largest first); at 40 GiB none does
    assert ("zero_bubble holding fewer micro-batches back for W fits in 80 GiB per device: zero_bubble_max_waiting=0: "
            "largest stage 72.3 GiB (") in out
    cfg = run_config("llama3_70b", "pipeline_schedule=zero_bubble", "grad_accum_dtype=bf16")
    print_memory_plan(plan_spec(cfg, plan_world_size(cfg)))
    assert ("zero_bubble holding fewer micro-batches back for W fits in 80 GiB per device: zero_bubble_max_waiting=4: "
            "largest stage 76.9 GiB; zero_bubble_max_waiting=3: largest stage 74.0 GiB; zero_bubble_max_waiting=2: "
            "largest stage 71.7 GiB; zero_bubble_max_waiting=1: largest stage 63.5 GiB; zero_bubble_max_waiting=0: "
            "largest stage 53.1 GiB") in capsys.readouterr().out
    cfg = run_config("llama3_70b", "pipeline_schedule=zero_bubble", "device_memory_gb=40")
    print_memory_plan(plan_spec(cfg, plan_world_size(cfg)))
    assert ("zero_bubble: no zero_bubble_max_waiting fits either (pipeline_schedule=1f1b holds the least)"
            in capsys.readouterr().out)


def test_llama3_70b_fits_under_zero_bubble_with_max_waiting_1(capsys):
    """Holding at most one micro-batch back for W per stage brings every stage back under 80 GB (summing gradients
    in bf16: in fp32 only zero_bubble_max_waiting=0 fits, above)."""
    cfg = run_config("llama3_70b", "pipeline_schedule=zero_bubble", "zero_bubble_max_waiting=1",
                     "grad_accum_dtype=bf16")
    rows = print_memory_plan(plan_spec(cfg, plan_world_size(cfg)))
    out = capsys.readouterr().out
    assert "(at most 1 micro-batches waiting for W)" in out and "does NOT fit" not in out
    assert all(row["fits"] for row in rows) and {row["waiting_for_weight_grads"] for row in rows} == {0, 1}


def test_model_config_from_a_model_directory(tmp_path):
    make_tiny_model("llama3", str(tmp_path / "hf"))
    cfg = run_config("tiny", f"model_name_or_path={tmp_path / 'hf'}", "seq_length=64")  # the model's positions
    config = load_plan_model_config(cfg)
    assert config.num_key_value_heads == 2
    rows = memory_plan(plan_spec(cfg, 2))
    assert [row["layers"] for row in rows] == [(0, 3), (3, 7)]


def test_no_model_config_is_a_clear_error(tmp_path):
    cfg = run_config("tiny", f"model_name_or_path={tmp_path}")
    with pytest.raises(ConfigError, match="plan_only needs a model config"):
        load_plan_model_config(cfg)


def test_stages_must_divide_the_world_size():
    cfg = run_config("llama_65b")
    with pytest.raises(ConfigError, match="does not divide"):
        memory_plan(plan_spec(cfg, 12))


def test_world_size_to_plan_for(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert plan_world_size(run_config("llama_65b")) == 16  # the config's 2 nodes x 8 devices
    assert plan_world_size(run_config("llama_65b", "plan_world_size=null")) == 8  # one replica of the stages
    monkeypatch.setenv("WORLD_SIZE", "32")
    assert plan_world_size(run_config("llama_65b", "plan_world_size=null")) == 32


# Tensor parallelism. llama_65b's published sizes: what tensor_parallel_size splits (q, k, v, o, gate, up, down;
# embedding and LM head rows) and what every rank holds whole (the two norms of each decoder, the final norm).
HIDDEN, INTER, VOCAB = 8192, 22016, 32000
DECODER_SHARDED, DECODER_REPLICATED = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER, 2 * HIDDEN
# 4 stages of 20 decoder layers: (sharded, replicated) parameters of each stage.
STAGE_PARAMETERS = [(VOCAB * HIDDEN + 20 * DECODER_SHARDED, 20 * DECODER_REPLICATED),
                    (20 * DECODER_SHARDED, 20 * DECODER_REPLICATED),
                    (20 * DECODER_SHARDED, 20 * DECODER_REPLICATED),
                    (20 * DECODER_SHARDED + VOCAB * HIDDEN, 20 * DECODER_REPLICATED + HIDDEN)]


def four_stage_plan(tensor_parallel, world_size, *overrides):
    cfg = run_config("llama_65b", "num_stages=4", "partition=[20,20,20,20]", "offload_optimizer=none",
                     f"tensor_parallel_size={tensor_parallel}", *overrides)
    spec = plan_spec(cfg, world_size)
    return spec.workload, memory_plan(spec)


def test_tensor_parallel_splits_sharded_weights_and_keeps_norms_whole():
    one, rows_one = four_stage_plan(1, 8)
    two, rows_two = four_stage_plan(2, 16)
    assert one.data_parallel == two.data_parallel == 2 and two.tensor_parallel == 2
    for one_row, two_row, (sharded, replicated) in zip(rows_one, rows_two, STAGE_PARAMETERS):
        assert one_row["parameters"] == sharded + replicated
        per_device = sharded // 2 + replicated
        assert two_row["parameters"] == per_device
        # bf16 weights, gradients summed in fp32 beside the bf16 .grad; fp32 master and Adam moments (12 bytes)
        # over the 2 data-parallel ranks.
        assert two_row["weights_bytes"] == 2 * per_device and two_row["gradients_bytes"] == 6 * per_device
        assert two_row["optimizer_bytes"] == 6 * per_device
        # Half of everything, plus the other half of the norms' 2 bytes per replicated parameter.
        assert two_row["weights_bytes"] == one_row["weights_bytes"] // 2 + replicated
        # Every matmul splits; under sequence parallelism the norms run on half the tokens: half the FLOPs.
        assert two_row["tflops_per_micro_batch"] == pytest.approx(one_row["tflops_per_micro_batch"] / 2, rel=1e-12)


def test_sequence_parallel_and_recomputed_gathers_shrink_activations():
    tokens_hidden_bytes = 2048 * HIDDEN * 2  # one full-sequence hidden-states tensor in bf16
    _, whole = four_stage_plan(1, 8)
    _, no_sequence = four_stage_plan(2, 16, "sequence_parallel=false")
    _, sequence = four_stage_plan(2, 16)
    _, recompute = four_stage_plan(2, 16, "recompute_sequence_gather=true")
    for rows in (no_sequence, sequence, recompute):  # activations change nothing in the state
        assert [row["weights_bytes"] for row in rows] == [row["weights_bytes"] for row in sequence]
    for a, b, c, d in zip(whole, no_sequence, sequence, recompute):
        # Heads and MLP columns split; then the residual stream; then the gathered inputs are not kept.
        assert a["activation_full_bytes"] > b["activation_full_bytes"] > c["activation_full_bytes"] \
            > d["activation_full_bytes"]
        # Checkpointed, only the recomputed layer holds gathered inputs: recomputing the gather saves nothing there.
        assert a["activation_checkpointed_bytes"] > b["activation_checkpointed_bytes"] \
            > c["activation_checkpointed_bytes"] >= d["activation_checkpointed_bytes"]
    # Stage 1, no checkpointing: 3 micro-batches in flight x 20 layers x 2 column groups (q/k/v, gate/up) each
    # keep their all-gathered input; recomputing keeps this rank's half instead, plus one pooled gather buffer.
    assert sequence[1]["in_flight"] == 3
    saved = 3 * 20 * 2 * tokens_hidden_bytes // 2
    assert sequence[1]["activation_full_bytes"] - recompute[1]["activation_full_bytes"] == saved - tokens_hidden_bytes
    # A stage boundary's hidden states split by token: the checkpointed stage keeps 22 per micro-batch in flight
    # (input, output, one per layer) and 3 buffers, all halved; the recomputed layer is in what remains.
    halved = (3 * 22 + 3) * tokens_hidden_bytes // 2
    assert no_sequence[1]["activation_checkpointed_bytes"] - sequence[1]["activation_checkpointed_bytes"] > halved


def test_tensor_parallel_plan_header(capsys):
    cfg = run_config("llama_65b", "num_stages=4", "tensor_parallel_size=2")
    rows = print_memory_plan(plan_spec(cfg, 16))
    printed = capsys.readouterr().out
    assert len(rows) == 4
    assert "16 devices = 4 stages x 2 tensor-parallel x 2 data-parallel" in printed
    assert "tensor-parallel 2 (sequence parallel)" in printed and "params and GiB per device" in printed


def test_world_size_must_divide_by_stages_times_tensor_parallel():
    cfg = run_config("llama_65b", "tensor_parallel_size=2")
    with pytest.raises(ConfigError, match=r"num_stages=8 x tensor_parallel_size=2 does not divide the world size "
                                          r"24: .* a multiple of 16 processes"):
        memory_plan(plan_spec(cfg, 24))


def test_tensor_parallel_must_divide_heads_and_vocabulary():
    cfg = run_config("llama_65b", "tensor_parallel_size=3")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=64, "
                                          r"num_key_value_heads=64, intermediate_size=22016, vocab_size=32000"):
        memory_plan(plan_spec(cfg, 24))


def test_granite_3_vocabulary_refuses_tensor_parallelism_before_any_weight():
    """Granite 3.3's 49159 vocabulary rows split over no tensor-parallel size (the head is vocabulary-parallel)."""
    cfg = run_config("granite3_8b", "tensor_parallel_size=2", "num_stages=2")
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=2 does not divide vocab_size=49159; choose a "):
        memory_plan(plan_spec(cfg, 8))


def test_configs_without_tensor_parallel_keys_and_the_fallback_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert plan_world_size(run_config("llama_65b", "plan_world_size=null", "tensor_parallel_size=2")) == 16
    cfg = run_config("llama_65b")
    with open_dict(cfg):
        for key in ("tensor_parallel_size", "sequence_parallel", "recompute_sequence_gather"):
            del cfg[key]
    workload = plan_spec(cfg, 16).workload
    assert (workload.tensor_parallel, workload.data_parallel) == (1, 2)


def test_async_save_snapshot_is_planned_and_a_node_without_room_for_it_is_one_line(capsys):
    """The snapshot holds each stage's bf16 weights and its whole fp32 master and Adam moments (2 + 12 bytes a
    parameter) over the stage's 2 data-parallel ranks; the node's sum is what the start-up check compares."""
    spec = plan_spec(run_config("llama_65b", "async_save=true"), 16)
    rows = print_memory_plan(spec)
    printed = capsys.readouterr().out
    assert all(row["snapshot_bytes"] == 7 * row["parameters"] for row in rows)
    without = plan_spec(run_config("llama_65b"), 16)
    node_snapshots = [snapshot_bytes_of_ranks(spec, range(start, start + 8)) for start in (0, 8)]
    assert node_snapshots == [2 * sum(row["snapshot_bytes"] for row in rows[first:first + 4]) for first in (0, 4)]
    synchronous = memory_plan(without)  # whose saves hold the host copies of each rank's largest file instead
    node_saves = [2 * sum(row["save_host_bytes"] for row in synchronous[first:first + 4]) for first in (0, 4)]
    assert all(row["save_host_bytes"] == 0 for row in rows) and min(node_saves) > 0
    assert host_memory_plan(spec, rows) == [plain - saves + snapshot for plain, saves, snapshot in zip(
        host_memory_plan(without, synchronous), node_saves, node_snapshots)]
    per_node = sum(node_snapshots) / 2 / GIB
    assert f"+ async_save snapshot {per_node:.1f} GiB (in /dev/shm: each rank's checkpoint files) +" in printed
    assert f"largest node {max(host_memory_plan(spec, rows)) / GIB:.1f} GiB" in printed
    assert snapshot_room_error(node_snapshots[0], 8, shared_free_bytes=64 * 2**20, available_bytes=900 * GIB) == (
        f"async_save=true holds about {node_snapshots[0] / GIB:.2f} GiB of host memory on this node from the first "
        f"save on (a snapshot of the checkpoint files of its 8 rank(s), in /dev/shm), but /dev/shm has 64.0 MiB free "
        f"and the host 900.00 GiB available: set async_save=false (saves then stop training while they write), or "
        f"give the job more memory or a larger /dev/shm (docker --shm-size, a memory-backed emptyDir), or spread the "
        f"run over more nodes.")
    assert snapshot_room_error(node_snapshots[0], 8, 1024 * GIB, 1024 * GIB) is None
    with pytest.raises(ValueError, match=r"^async_save=true holds about .* this node .* but /dev/shm has "):
        snapshot_shortfall(True, node_snapshots[0], 8)  # this host: far less than a 65B node's snapshot
    assert snapshot_shortfall("auto", node_snapshots[0], 8).startswith("async_save=auto holds about ")
    assert snapshot_room_error(node_snapshots[0], 8, 64 * 2**20, 900 * GIB, "auto").endswith(
        "available: so every rank saves synchronously (saves stop training while they write); to save in the "
        "background, give the job more memory or a larger /dev/shm (docker --shm-size, a memory-backed emptyDir), or "
        "spread the run over more nodes.")


def _agree_on_async_save(rank, shortfalls, out):
    os.environ["LOCAL_RANK"] = "0"  # each rank its node's first: each says why its node saves synchronously
    import contextlib
    import io
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for case, shortfall in enumerate(shortfalls[rank]):
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            verdict = agreed_async_save(shortfall)
        (out / f"{case}.{rank}").write_text(f"{verdict}|{printed.getvalue()}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_async_save_auto_saves_synchronously_on_every_rank_when_one_node_has_no_room(tmp_path):
    """async_save=auto: one all-reduce makes the verdict every rank's (a checkpoint's ranks save one way); the node
    without room names why."""
    from tests.distributed import spawn
    lacking = "async_save=auto holds about 9.00 GiB of host memory on this node ..."
    spawn(_agree_on_async_save, 2, [[None, None], [None, lacking]], tmp_path)
    assert [(tmp_path / f"{case}.{rank}").read_text() for case in (0, 1) for rank in (0, 1)] == [
        "True|", "True|", "False|", f"False|trainer_pipe: warning: {lacking}\n"]
