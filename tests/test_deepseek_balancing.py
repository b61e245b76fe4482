"""DeepSeek-V3's balancing in training: the sequence-wise balance loss (moe.sequence_aux_loss_coef) equal to a direct
computation of the paper's definition on transformers' model, loss and every gradient; the correction-bias update
(moe.bias_update_rate) after each optimizer step equal to a transformers + torch AdamW loop applying the same rule,
on 1 process and 2 stages x 2 data-parallel, its biases saved, resumed on another layout and exported; and the
settings refused where they do not apply."""
import copy

import pytest
import torch

from models.loss import CausalLMLoss
from models.router_loss import LoadBalancingLoss
from tests.test_moe import pipeline_loss_and_grads
from tests.tiny_models import DEEPSEEK_CONFIGS, make_batch, make_model

ALPHA = 0.5  # large enough that the loss moves every router's gradient well past the tolerances


def captured_routing(model):
    """[(router logits, top-k ids) of each sparse layer, in layer order], filled by model's next forward."""
    captured = []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda _, __, out: captured.append((out[0], out[2])))
    return captured


def direct_sequence_loss(captured, attention_mask, num_experts, top_k):
    """The DeepSeek-V3 paper's sequence-wise balance loss (eq. 17-20) before alpha, written out sequence by
    sequence: per layer, the mean over the rows of sum_i f_i P_i, f_i = E / (K T) * (the row's real tokens choosing
    i), P_i the mean over the row's real tokens of the sigmoid scores normalised over the experts; summed over the
    layers."""
    rows, seq = attention_mask.shape
    total = 0
    for logits, expert_ids in captured:
        logits, expert_ids = logits.view(rows, seq, -1), expert_ids.view(rows, seq, -1)
        per_row = []
        for row in range(rows):
            real = attention_mask[row].bool()
            length = real.sum()
            scores = logits[row][real].sigmoid()
            normalised = scores / scores.sum(dim=-1, keepdim=True)
            chosen = torch.stack([(expert_ids[row][real] == i).any(dim=-1).sum() for i in range(num_experts)])
            fractions = chosen * num_experts / (top_k * length)
            per_row.append((fractions * normalised.mean(dim=0)).sum())
        total = total + torch.stack(per_row).mean()
    return total


@pytest.mark.parametrize("chunk_tokens", [0, 7], ids=["logits", "chunked"])
@pytest.mark.parametrize("family", list(DEEPSEEK_CONFIGS))
def test_sequence_aux_loss_equals_the_papers_definition_on_transformers(tmp_path, family, chunk_tokens):
    """On padded rows (each row a sequence of its real tokens): the loss is transformers' cross-entropy plus alpha
    times the direct computation over its routers' own logits and choices, and every gradient (the routers'
    through the normalised scores) is that sum's gradient; aux_loss logs the direct value."""
    config = DEEPSEEK_CONFIGS[family]()
    hf_model = make_model(config, tmp_path)
    batch = make_batch(3, 16, config.vocab_size, seed=1)
    assert batch[1].sum(dim=1).unique().numel() > 1  # rows of different lengths
    captured = captured_routing(hf_model)
    input_ids, attention_mask, labels = batch
    outputs = hf_model(input_ids, attention_mask=attention_mask, labels=labels)
    direct = direct_sequence_loss(captured, attention_mask, config.n_routed_experts, config.num_experts_per_tok)
    (outputs.loss + ALPHA * direct).backward()
    ref_grads = {name: param.grad for name, param in hf_model.named_parameters()}

    with_loss = copy.deepcopy(config)
    with_loss.sequence_aux_loss_coef = ALPHA  # the run's moe.sequence_aux_loss_coef (training/config_checks.py)
    loss, grads, router = pipeline_loss_and_grads(with_loss, hf_model, batch, chunk_tokens)
    assert direct.item() > 0.5  # weighted by ALPHA, far past the tolerance
    assert loss.item() == pytest.approx((outputs.loss + ALPHA * direct).item(), abs=1e-6)
    errors = {name: ((grads[name] - ref).abs().max() / ref.abs().max()).item() for name, ref in ref_grads.items()}
    assert max(errors.values()) < 1e-5, errors
    assert router.take_metrics()["aux_loss"] == pytest.approx(direct.item(), abs=1e-6)


def test_without_the_coefficient_the_loss_is_transformers(tmp_path):
    """moe.sequence_aux_loss_coef=0 (the default): no floating sum is carried and the loss is outputs.loss."""
    from models.pipeline_layers import StageTuple
    config = DEEPSEEK_CONFIGS["deepseek_v3"]()
    initial_routing = lambda config, device: StageTuple(config).initial_routing(device).tensors()  # noqa: E731
    hf_model = make_model(config, tmp_path)
    batch = make_batch(2, 16, config.vocab_size, seed=1)
    assert len(initial_routing(config, "cpu")) == 1
    loss, _, router = pipeline_loss_and_grads(config, hf_model, batch, 7)
    assert loss.item() == pytest.approx(hf_model(batch[0], attention_mask=batch[1], labels=batch[2]).loss.item(),
                                        abs=1e-6)
    assert "aux_loss" not in router.take_metrics()


# --- the bias update in training -------------------------------------------------------------------------------------

RATE = 0.01  # the correction biases are ~0.1 (tests/tiny_models.py make_model): a step moves the choice


@pytest.fixture(scope="module")
def demo_deepseek_mtp(demo_model, tmp_path_factory):
    """The tiny DeepSeek-V3 (query latent, groups, shared expert, dense first layer) over the demo model's tokenizer,
    its checkpoint shipping a multi-token-prediction layer: {hf, ds, mtp: {name: tensor}}."""
    from checkpoints.hf_to_ds import convert_hf_to_ds
    from tests.test_deepseek_conversion import mtp_tensors, with_mtp_shard
    from tests.test_moe import demo_model_of
    config = DEEPSEEK_CONFIGS["deepseek_v3"]()
    config.num_nextn_predict_layers = 1
    root = tmp_path_factory.mktemp("demo_deepseek_mtp")
    dirs = demo_model_of(config, demo_model, root)
    mtp = mtp_tensors(config)
    with_mtp_shard(dirs["hf"], mtp)
    convert_hf_to_ds(dirs["hf"], dirs["ds"], overwrite=True)
    return {**dirs, "mtp": mtp}


def transformers_balanced_steps(hf_dir, batches, micro_batch_size, rate):
    """(losses, gradient norms before clipping, each sparse layer's final correction bias) of transformers' model
    and torch's AdamW on each step's global batch (its micro-batches' token-mean cross-entropy, as
    tests/test_moe.py transformers_steps), moving each router's e_score_correction_bias after every optimizer step
    by rate * sign(mean load - load), a load being the step's real tokens that chose the expert."""
    from transformers import AutoModelForCausalLM

    from tests.test_moe import LEARNING_RATE, MAX_GRAD_NORM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    loads = {gate: torch.zeros(gate.num_experts) for gate in gates}
    real = {}

    def count(gate, _, outputs):
        chosen = outputs[2][real["tokens"]]
        loads[gate] += torch.bincount(chosen.reshape(-1), minlength=gate.num_experts)
    for gate in gates:
        gate.register_forward_hook(count)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses, norms = [], []
    for (input_ids, document_ids, position_ids), labels in batches:
        total_tokens = (labels[:, 1:] != -100).sum()
        step_loss = 0.0
        for rows in torch.arange(input_ids.shape[0]).split(micro_batch_size):
            real["tokens"] = (document_ids[rows] != 0).reshape(-1)
            loss = model(input_ids=input_ids[rows], attention_mask=(document_ids[rows] != 0).long(),
                         position_ids=position_ids[rows], labels=labels[rows]).loss
            loss = loss * (labels[rows, 1:] != -100).sum() / total_tokens
            loss.backward()
            step_loss += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for gate in gates:
                gate.e_score_correction_bias += rate * torch.sign(loads[gate].mean() - loads[gate])
                loads[gate].zero_()
        losses.append(step_loss)
    return losses, norms, [gate.e_score_correction_bias.clone() for gate in gates]


def exported_biases(hf_dir):
    """Each sparse layer's e_score_correction_bias in an exported model, in layer order."""
    from tests.test_conversion import load_hf_weights
    weights = load_hf_weights(str(hf_dir))
    names = sorted((name for name in weights if name.endswith("mlp.gate.e_score_correction_bias")),
                   key=lambda name: int(name.split(".")[2]))
    return [weights[name] for name in names]


BALANCING_LAYOUTS = {"1_process": (1, dict(num_stages=1, gradient_accumulation_steps=4, zero_stage=0)),
                     "2stages_x_2dp": (4, dict(num_stages=2, gradient_accumulation_steps=2, zero_stage=1)),
                     # the experts split over the 2 ranks of a context group: each routes its tokens of every
                     # row, the step's loads given once per group
                     "2stages_x_ep2_x_cp2": (4, dict(num_stages=2, gradient_accumulation_steps=2, zero_stage=1,
                                                     expert_parallel_size=2, context_parallel_size=2)),
                     # each rank routing its half of the tokens, every layer's forward run again in backward
                     "2stages_x_tp2_checkpointed": (4, dict(num_stages=2, tensor_parallel_size=2,
                                                            gradient_accumulation_steps=4, zero_stage=0,
                                                            activation_checkpoint_interval=1))}


def train_balanced(demo_model, model_dirs, train_file, out, procs, settings, **extra):
    return train_instruction_steps(demo_model, model_dirs, train_file, out, procs, settings,
                                   **{"moe.bias_update_rate": RATE, **extra})


def train_instruction_steps(demo_model, model_dirs, train_file, out, procs, settings, **extra):
    """The logged step records of TRAIN_STEPS steps on padded instruction rows with clipping active, saving at step
    3 and exporting, from the converted model in model_dirs["ds"]: the run the balancing and MTP tests compare."""
    from tests.launch import check_ok, launch_trainer, logged_steps
    check_ok(launch_trainer(procs, instruction_overrides(demo_model, model_dirs, train_file, out, settings, **extra)))
    return logged_steps(out)


def instruction_overrides(demo_model, model_dirs, train_file, out, settings, **extra):
    """train_instruction_steps' run as trainer overrides."""
    from tests.launch import demo_overrides
    from tests.test_moe import LEARNING_RATE, MAX_GRAD_NORM, TRAIN_STEPS
    from tests.test_token_mean import MICRO_BATCH as ROWS, SEED, SEQ as TRAIN_SEQ
    return demo_overrides(demo_model, out, **{
        **settings, "model_name_or_path": model_dirs["ds"], "train_file": str(train_file), "eval_file": "null",
        "data.format": "instruction", "data.cache_dir": str(out.parent / "cache"), "seq_length": TRAIN_SEQ,
        "micro_batch_size": ROWS, "max_steps": TRAIN_STEPS, "logging_steps": 1, "learning_rate": LEARNING_RATE,
        "lr_scheduler": "constant", "warmup_steps": 0, "max_grad_norm": MAX_GRAD_NORM, "seed": SEED,
        "save_steps": 3, "export_hf": "true", **extra})


@pytest.mark.slow
@pytest.mark.parametrize("layout", BALANCING_LAYOUTS)
def test_bias_update_equals_transformers_and_resumes_on_another_layout(demo_model, demo_deepseek_mtp, tmp_path,
                                                                       layout):
    """Six steps (padded instruction rows, clipping active) with moe.bias_update_rate, on 1 process, 2 stages x 2
    data-parallel with the experts replicated, 2 stages x context 2 with the experts split over the context group
    (expert parallelism), and 2 stages x tensor parallel 2 (sequence parallel) with activation checkpointing (the
    loads counted once): the logged losses and the
    step-1 gradient norm are those of transformers + AdamW applying the same rule after each step (which differ
    from the frozen bias's), and the exported model holds the biases that loop ends with. The checkpoint of step 3
    holds the biases of step 3: 2 stages x 2 data-parallel resumed on 1 stage x 2 data-parallel (the optimizer
    state resharded) trains steps 4 to 6 as the straight run did, to the same biases. Every export carries the
    checkpoint's multi-token-prediction layer bit for bit."""
    from tests.test_conversion import load_hf_weights
    from tests.test_moe import MAX_GRAD_NORM, TRAIN_STEPS
    from tests.test_token_mean import MICRO_BATCH as ROWS, global_batches, write_skewed_instructions
    procs, settings = BALANCING_LAYOUTS[layout]
    train_file = write_skewed_instructions(demo_model, tmp_path / "train.jsonl")
    records = train_balanced(demo_model, demo_deepseek_mtp, train_file, tmp_path / "run", procs, settings)

    def batches():
        return global_batches(demo_model, train_file,
                              procs // settings["num_stages"] // settings.get("tensor_parallel_size", 1)
                              // settings.get("context_parallel_size", 1),
                              settings["gradient_accumulation_steps"], tmp_path / "ref", steps=TRAIN_STEPS)
    losses, norms, biases = transformers_balanced_steps(demo_deepseek_mtp["hf"], batches(), ROWS, RATE)
    frozen, _, _ = transformers_balanced_steps(demo_deepseek_mtp["hf"], batches(), ROWS, 0.0)
    assert min(norms) > MAX_GRAD_NORM  # clipping acts on every step
    assert max(abs(a - b) for a, b in zip(losses, frozen)) > 1e-4  # the update changes the routing: 10x the tolerance
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=1e-5, rel=0)
    assert records[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-4)
    assert all(r[f"expert_load/layer_{i}"] >= 1.0 for r in records for i in (1, 2, 3))
    assert all("expert_load/layer_0" not in r for r in records)  # first_k_dense_replace=1
    exported = exported_biases(tmp_path / "run" / "hf")
    assert len(exported) == 3 and all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(exported, biases))
    weights = load_hf_weights(str(tmp_path / "run" / "hf"))
    assert all(torch.equal(weights[name], tensor) for name, tensor in demo_deepseek_mtp["mtp"].items())
    if layout != "2stages_x_2dp":
        return
    resumed = train_balanced(demo_model, demo_deepseek_mtp, train_file, tmp_path / "resumed", 2,
                             dict(settings, num_stages=1), resume=str(tmp_path / "run" / "global_step3"))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records[3:]], abs=1e-5, rel=0)
    assert [r["grad_norm"] for r in resumed] == pytest.approx([r["grad_norm"] for r in records[3:]], rel=1e-4)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7)
               for a, b in zip(exported_biases(tmp_path / "resumed" / "hf"), exported))
    resumed_weights = load_hf_weights(str(tmp_path / "resumed" / "hf"))
    assert all(torch.allclose(resumed_weights[name], tensor, rtol=0, atol=1e-5) for name, tensor in weights.items())
    assert all(torch.equal(resumed_weights[name], tensor) for name, tensor in demo_deepseek_mtp["mtp"].items())


@pytest.mark.parametrize("model,overrides,message", [
    ("qwen3_moe", ["moe.bias_update_rate=0.001"], r"^moe\.bias_update_rate=0\.001 applies to DeepSeek-V3's router "
                                                  r"\(deepseek_v3, glm4_moe\), and qwen3_moe has another router; set "
                                                  r"moe\.bias_update_rate=0\.$"),
    ("llama", ["moe.sequence_aux_loss_coef=0.0001"], r"^moe\.sequence_aux_loss_coef=0\.0001 applies to DeepSeek-V3's "
                                                     r"router \(deepseek_v3, glm4_moe\), and llama has no router; set "
                                                     r"moe\.sequence_aux_loss_coef=0\.$"),
    ("deepseek_v3", ["moe.bias_update_rate=-0.001"], r"^moe\.bias_update_rate=-0\.001 must be a number >= 0 \(0: off; "
                                                     r"DeepSeek-V3's paper used 0\.001\)\.$"),
    ("deepseek_v3", ["moe.sequence_aux_loss_coef=true"], r"^moe\.sequence_aux_loss_coef=True must be a number >= 0"),
    ("deepseek_v3", ["moe.bias_update_rate=0.001", "lora.rank=4"],
     r"^moe\.bias_update_rate=0\.001 with lora\.rank=4: the correction biases belong to the frozen base, which a LoRA "
     r"checkpoint does not save; set moe\.bias_update_rate=0\.$"),
    ("deepseek_v3", ["+moe.bias_rate=0.001"], r"^unknown config key 'moe\.bias_rate': did you mean moe\.bias_update_rate"),
    ("deepseek_v3", ["moe.sequence_aux_loss_coef=0.01", "objective=dpo", "data.format=preference"],
     r"^moe\.sequence_aux_loss_coef=0\.01 with objective=dpo: TRL's preference trainers add transformers' auxiliary "
     r"loss only, which these families have none of; set moe\.sequence_aux_loss_coef=0\.$"),
], ids=["other_router", "dense", "negative", "not_a_number", "lora", "misspelt", "dpo"])
def test_balancing_settings_are_refused_where_they_do_not_apply(demo_model, tiny_moe_checkpoints,
                                                                tiny_deepseek_checkpoints, tmp_path, model, overrides,
                                                                message):
    from tests.test_moe import run_spec_of
    from training.config_checks import ConfigError
    model_dir = {"llama": demo_model["ds"], "qwen3_moe": tiny_moe_checkpoints["qwen3_moe"][1],
                 "deepseek_v3": tiny_deepseek_checkpoints["deepseek_v3"][1]}[model]
    with pytest.raises(ConfigError, match=message):
        run_spec_of(demo_model, model_dir, tmp_path, *overrides)


def test_the_coefficient_reaches_the_model_config(demo_model, tiny_deepseek_checkpoints, tmp_path):
    from models.architecture import architecture_of
    from tests.test_moe import run_spec_of
    spec = run_spec_of(demo_model, tiny_deepseek_checkpoints["glm4_moe"][1], tmp_path,
                       "moe.sequence_aux_loss_coef=0.01", "moe.bias_update_rate=0.001")
    assert architecture_of(spec.model_config).moe.sequence_aux_loss_coef == 0.01


def test_balancing_takes_no_host_sync():
    """DeepSeek-V3's router, the sequence-wise loss and the step's loads kept for the bias update: no op reads a
    device value on the host over three padded micro-batches; the loads are read once, after the step."""
    from tests.test_moe import stage_syncs
    config = DEEPSEEK_CONFIGS["deepseek_v3"]()
    config.vocab_size = 512  # the host-sync rows' token ids
    config.sequence_aux_loss_coef = ALPHA
    loss_fn = CausalLMLoss(chunk_tokens=5, router=LoadBalancingLoss(config, counts_step_loads=True))
    syncs, batches = stage_syncs(config, loss_fn)
    assert syncs == []
    real_tokens = sum(int((batch[0][1] != 0).sum()) for batch in batches)
    # the stage's one sparse layer (layer 1) counted every real token's top-k; layers 2 and 3 ran on no stage here
    assert loss_fn.router.take_step_loads().sum(dim=1).tolist() == [config.num_experts_per_tok * real_tokens, 0, 0]
