"""Multi-token prediction trained on the last stage (models/multi_token_prediction.py): with mtp_loss_scale > 0 the
pipeline's loss is the next-token loss plus the scale times the MTP layer's next-next-token loss, both divided by
the labelled tokens, and every gradient (the shared embedding's and head's from both uses, the MTP layer's own) is
that of a plain torch reference built from the same weights: transformers' model for the main hidden states, its
own decoder layer class for the MTP layer, run on each document alone (padded rows and packed rows)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import IGNORE_INDEX
from models.layout import hf_name_of_layer_key, layer_of_hf_name
from models.context_parallel import NO_CONTEXT_PARALLEL
from models.loss import CausalLMLoss, mtp_labels, split_micro_batch
from models.multi_token_prediction import MultiTokenPrediction, mtp_layout_of, next_tokens
from models.pipeline import build_pipeline_layers
from models.pipeline_layers import lm_head
from tests.tiny_models import DEEPSEEK_CONFIGS, HYBRID_CONFIGS, make_batch, make_model

SCALE = 0.3  # not Megatron-Bridge's 0.1: a larger share of the gradient, so a wrong MTP term shows


MTP_FAMILIES = {**DEEPSEEK_CONFIGS, "qwen3_5": HYBRID_CONFIGS["qwen3_5"], "qwen3_5_moe": HYBRID_CONFIGS["qwen3_5_moe"]}


def tiny_config(family):
    config = MTP_FAMILIES[family]()
    if config.model_type.startswith("qwen3_5"):
        config.mtp_num_hidden_layers = 1
        config.output_router_logits = False  # the reference has the MTP term alone (tests/test_qwen3_5.py: the rest)
    else:
        config.num_nextn_predict_layers = 1
    config.mtp_loss_scale = SCALE  # as training/config_checks.py sets it from the run's mtp_loss_scale
    return config


def mtp_hub_tensors(config, seed=5):
    """Random tensors for every tensor of the MTP layer, under the checkpoint's names (DeepSeek-V3's
    model.layers.{L}.*): norms near 1, projections and experts small, the router's correction bias random."""
    layout = mtp_layout_of(config)
    with torch.device("meta"):
        shapes = MultiTokenPrediction(config).state_dict()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, meta in shapes.items():
        noise = torch.randn(meta.shape, generator=gen)
        tensors[layout.hub_name(key)] = 1 + 0.1 * noise if "norm" in key else 0.1 * noise
    return tensors


# The reference's own names of the MTP layer's parts, after DeepSeek-V3's paper (models/multi_token_prediction.py's
# names on the left).
REFERENCE_NAMES = {"embedding_norm.": "enorm.", "hidden_norm.": "hnorm.", "projection.": "eh_proj.",
                   "norm.": "shared_head_norm.", "layer.": "layer."}


def reference_parts(config):
    """(transformers' decoder layer class, its RMSNorm class) of a family."""
    if config.model_type == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm
        return Glm4MoeDecoderLayer, Glm4MoeRMSNorm
    if config.model_type == "qwen3_5_text":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
        return Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    if config.model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm
        return Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    return DeepseekV3DecoderLayer, DeepseekV3RMSNorm


def reference_key(key):
    ours = next(prefix for prefix in REFERENCE_NAMES if key.startswith(prefix))
    return REFERENCE_NAMES[ours] + key.removeprefix(ours)


class ReferenceMTP(nn.Module):
    """The MTP layer in plain torch and transformers' own parts (vLLM's and Megatron's order of the concatenation,
    the shared embedding and head passed in): DeepSeek-V3's (its decoder layer L), Qwen3.5's (a full-attention
    layer, (1 + w) norms)."""

    def __init__(self, config, tensors):
        super().__init__()
        layer_class, norm = reference_parts(config)
        layer_config, index = mtp_layout_of(config).layer_config(config)
        layer_config._attn_implementation = "eager"
        self.enorm, self.hnorm = (norm(config.hidden_size, eps=config.rms_norm_eps) for _ in range(2))
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = layer_class(layer_config, index)
        self.shared_head_norm = norm(config.hidden_size, eps=config.rms_norm_eps)
        layout = mtp_layout_of(config)
        own = {reference_key(layout.key_of(name)): tensor for name, tensor in tensors.items()
               if layout.key_of(name) is not None}
        self.load_state_dict(own, strict=True)

    def forward(self, model, input_ids, labels):
        """(the main cross-entropy sum, the MTP one) of one document alone: input_ids (1, n), labels (1, n)."""
        hidden = model.model(input_ids).last_hidden_state  # after the final norm
        main = F.cross_entropy(model.lm_head(hidden)[0, :-1], labels[0, 1:], ignore_index=IGNORE_INDEX,
                               reduction="sum")
        n = input_ids.shape[1]
        if n < 3:
            return main, hidden.new_zeros(())
        embedded = model.model.embed_tokens(input_ids[:, 1:])
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden[:, :-1])], dim=-1))
        positions = torch.arange(n - 1)[None]
        mask = torch.full((n - 1, n - 1), torch.finfo(x.dtype).min).triu(1)[None, None]
        x = self.layer(x, attention_mask=mask, position_ids=positions,
                       position_embeddings=model.model.rotary_emb(x, positions))
        logits = model.lm_head(self.shared_head_norm(x))
        mtp = F.cross_entropy(logits[0, :-1], labels[0, 2:], ignore_index=IGNORE_INDEX, reduction="sum")
        return main, mtp


def packed_batch(config, seed=2):
    """Two rows of 16 packing documents of 2 to 9 tokens (a row's last document ends with it, the other row padded
    at its end): (input_ids, document_ids, positions, labels), each later document's first label -100 as the
    collator ignores it, and a prompt's labels -100 in one document."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
    document_ids = torch.tensor([[1] * 5 + [2] * 2 + [3] * 9, [1] * 7 + [2] * 4 + [3] * 3 + [0] * 2])
    positions = torch.zeros_like(input_ids)
    labels = input_ids.clone()
    for row in range(2):
        for doc in document_ids[row].unique().tolist():
            where = (document_ids[row] == doc).nonzero().squeeze(1)
            positions[row, where] = torch.arange(len(where))
            if doc > 1:
                labels[row, where[0]] = IGNORE_INDEX
    labels[document_ids == 0] = IGNORE_INDEX
    labels[0, 7:10] = IGNORE_INDEX  # the third document's prompt
    return input_ids, document_ids, positions, labels


def padded_batch(config):
    input_ids, attention_mask, labels = make_batch(2, 16, config.vocab_size, seed=1)
    return input_ids, attention_mask, torch.arange(16).expand_as(input_ids), labels


def documents(batch):
    """((input_ids (1, n), labels (1, n)), ...) of each document of a batch, alone."""
    input_ids, document_ids, _, labels = batch
    for row in range(input_ids.shape[0]):
        for doc in document_ids[row].unique().tolist():
            if doc:
                where = document_ids[row] == doc
                yield input_ids[row, where][None], labels[row, where][None]


def reference_loss_and_grads(config, model, tensors, batch):
    reference = ReferenceMTP(config, tensors)
    sums = [reference(model, ids, labels) for ids, labels in documents(batch)]
    divisor = sum((labels[0, 1:] != IGNORE_INDEX).sum() for _, labels in documents(batch))
    main, mtp = (sum(parts) / divisor for parts in zip(*sums))
    (main + SCALE * mtp).backward()
    layout = mtp_layout_of(config)
    grads = {name: param.grad for name, param in model.named_parameters()}
    ours = {reference_key(key): key for key in MultiTokenPrediction(config).state_dict()}
    grads.update({layout.hub_name(ours[key]): param.grad for key, param in reference.named_parameters()})
    return main.item(), mtp.item(), grads


def pipeline_loss_and_grads(config, model, tensors, batch, chunk_tokens, context=NO_CONTEXT_PARALLEL):
    """The pipeline's layers holding the model's and the MTP layer's weights, run one after the other on batch
    (under context parallelism on this rank's tokens of it): (the loss, its MTP term, {HF name: gradient}), this
    rank's."""
    layers = [spec.build() for spec in build_pipeline_layers(config, context=context, chunked_loss=chunk_tokens > 0)]
    layout, final_norm = mtp_layout_of(config), config.num_hidden_layers + 1
    state = {}
    for name, tensor in model.state_dict().items():
        index, key = layer_of_hf_name(name, config.num_hidden_layers, config.tie_word_embeddings)
        state.setdefault(index, {})[key] = tensor
    state[final_norm].update({f"mtp.{layout.key_of(name)}": tensor for name, tensor in tensors.items()})
    for index, layer in enumerate(layers):
        if index in state:
            layer.load_state_dict(state[index], strict=True)
    *inputs, labels = batch
    x, labels = split_micro_batch(context, (tuple(inputs), labels))
    for layer in layers[:-1]:
        x = layer(x)
    x = lm_head(layers[0], x, chunk_tokens > 0) if config.tie_word_embeddings else layers[-1](x)
    loss_fn = CausalLMLoss(chunk_tokens=chunk_tokens, context=context, mtp_scale=SCALE)
    loss = loss_fn(x, labels)
    loss.backward()
    assert loss_fn.take_aux_terms() == []  # a training forward keeps none
    with torch.no_grad():  # an evaluation forward keeps its added term, here the MTP loss times SCALE
        loss_fn(x, labels)
    mtp_term, = loss_fn.take_aux_terms()
    grads = {}
    for index, layer in enumerate(layers):
        for key, param in layer.named_parameters():
            if index == final_norm and key.startswith("mtp."):
                grads[layout.hub_name(key.removeprefix("mtp."))] = param.grad
            elif param.grad is not None:
                grads.setdefault(hf_name_of_layer_key(index, key, config.num_hidden_layers), param.grad)
    if config.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return loss.item(), mtp_term.item() / SCALE, grads


@pytest.mark.parametrize("rows", ["padded", "packed"])
@pytest.mark.parametrize("chunk_tokens", [0, 7], ids=["logits", "chunked"])
@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_loss_and_gradients_equal_a_torch_reference(tmp_path, family, chunk_tokens, rows):
    """The loss (main + scale x MTP), its MTP term and every gradient, the MTP layer's and the shared embedding's
    and head's included, against the reference on each document alone: packed documents' MTP terms restart at
    every boundary (the next token's embedding never crosses one), padded rows' last real token predicts nothing."""
    config = tiny_config(family)
    model = make_model(config, tmp_path)
    tensors = mtp_hub_tensors(config)
    batch = packed_batch(config) if rows == "packed" else padded_batch(config)
    loss, mtp, grads = pipeline_loss_and_grads(config, model, tensors, batch, chunk_tokens)
    ref_main, ref_mtp, ref_grads = reference_loss_and_grads(config, model, tensors, batch)
    assert ref_mtp > 1.0  # a real term: about the log of the vocabulary
    assert mtp == pytest.approx(ref_mtp, rel=1e-6)
    assert loss == pytest.approx(ref_main + SCALE * ref_mtp, rel=1e-6)
    mtp_names = [name for name in tensors if ref_grads.get(name) is not None]
    layout = mtp_layout_of(config)
    assert any(layout.key_of(name) == "projection.weight" for name in mtp_names)
    assert any(("experts" if config.model_type != "qwen3_5_text" else "self_attn.q_proj") in name
               for name in mtp_names)
    errors = {name: ((grads[name] - ref).abs().max() / ref.abs().max()).item()
              for name, ref in ref_grads.items() if ref is not None}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda item: -item[1])[:5]


# {family: loss_chunk_tokens}: multi-head latent attention, Qwen3.5's linear attention (a head all-to-all) and its
# gated full-attention MTP layer, Qwen3.5-MoE's experts
CONTEXT_PARALLEL_FAMILIES = {"deepseek_v3": 7, "qwen3_5": 0, "qwen3_5_moe": 7}


def context_parallel_worker(rank, model_dirs, out_dir):
    """Each family's loss, MTP term and gradients of the packed batch on context 2, as DeepSpeed averages the
    context group's (its data axis holds the context ranks), saved by rank 0."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from cluster.distributed import init_distributed
    from models.context_parallel import ContextParallel
    init_distributed(timeout_minutes=2)
    context = ContextParallel(2, rank, dist.group.WORLD)
    for family, chunk_tokens in CONTEXT_PARALLEL_FAMILIES.items():
        config = tiny_config(family)
        model = AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.float32)
        loss, mtp, grads = pipeline_loss_and_grads(config, model, mtp_hub_tensors(config), packed_batch(config),
                                                   chunk_tokens, context)
        averaged = torch.tensor([loss, mtp], dtype=torch.float64)
        for tensor in (averaged, *grads.values()):
            dist.all_reduce(tensor)
            tensor /= context.size
        if rank == 0:
            torch.save({"loss": averaged[0].item(), "mtp": averaged[1].item(), "grads": grads},
                       f"{out_dir}/{family}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_context_parallel_equals_the_reference(tmp_path):
    """On context 2 (zig-zag chunks of 4 of the packed rows of 16, documents crossing every rank boundary) the loss,
    its MTP term and every gradient equal the reference's on each document alone: the MTP layer's next token and
    label after next are the whole sequence's where they sit on the other rank, its attention is the context group's
    (latent attention's gathered latent, Qwen3.5's gated attention) and its loss divided as the main loss."""
    from tests.distributed import spawn
    models = {family: make_model(tiny_config(family), tmp_path / family) for family in CONTEXT_PARALLEL_FAMILIES}
    spawn(context_parallel_worker, 2, {family: str(tmp_path / family) for family in models}, str(tmp_path))
    for family, model in models.items():
        config = tiny_config(family)
        ours = torch.load(tmp_path / f"{family}.pt")
        ref_main, ref_mtp, ref_grads = reference_loss_and_grads(config, model, mtp_hub_tensors(config),
                                                                packed_batch(config))
        assert ours["mtp"] == pytest.approx(ref_mtp, rel=1e-6), family
        assert ours["loss"] == pytest.approx(ref_main + SCALE * ref_mtp, rel=1e-6), family
        errors = {name: ((ours["grads"][name] - ref).abs().max() / ref.abs().max()).item()
                  for name, ref in ref_grads.items() if ref is not None}
        assert max(errors.values()) < 1e-5, (family, sorted(errors.items(), key=lambda item: -item[1])[:5])


def test_labels_skip_positions_whose_next_token_is_another_document():
    labels = torch.tensor([[10, 11, 12, 13, -100, 21, 22, 23]])
    document_ids = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]])
    assert mtp_labels(labels, document_ids).tolist() == [12, 13, -100, -100, 22, 23, -100, -100]
    assert next_tokens(labels).tolist() == [[11, 12, 13, -100, 21, 22, 23, 23]]
    # labels one wider than the rows (token shards): the last but one position has a label, the last none
    assert mtp_labels(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 1, 1]]), positions=3).tolist() == [3, 4, -100]


def test_a_family_without_an_mtp_layer_is_refused():
    config = DEEPSEEK_CONFIGS["deepseek_v3"]()
    config.num_nextn_predict_layers = 0
    with pytest.raises(ValueError, match="declares 0 multi-token-prediction layers"):
        mtp_layout_of(config)
    from tests.tiny_models import TINY_CONFIGS
    llama = next(make() for make in TINY_CONFIGS.values())
    with pytest.raises(ValueError, match=f"model_type '{llama.model_type}' has no multi-token-prediction layer"):
        mtp_layout_of(llama)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5", "qwen3_5_moe"])
def test_the_planner_prices_the_mtp_layer_it_builds(family):
    """With mtp_loss_scale > 0 the final norm's layer holds the MTP layer: the planner's parameters of that layer
    (models/partition.py layer_parameter_counts, planner/stage_costs.py per rank) grow by the built layer's, on one
    rank and per tensor-parallel rank; its FLOPs and activations grow too, the head's twice, and every stage
    boundary carries a second hidden-sized tensor."""
    from models.partition import HEAD, NORM, layer_parameter_counts
    from planner.stage_costs import LayerCosts
    from planner.workload import Workload
    config = tiny_config(family)
    plain = copy.deepcopy(config)
    del plain.mtp_loss_scale
    norm = config.num_hidden_layers + 1
    built = MultiTokenPrediction(config)
    count = sum(p.numel() for p in built.parameters())
    assert layer_parameter_counts(config)[norm] - layer_parameter_counts(plain)[norm] == count
    workload = Workload(seq_length=16, micro_batch_size=2)
    costs, base = LayerCosts(config, workload), LayerCosts(plain, workload)
    assert costs.parameters[NORM] - base.parameters[NORM] == count
    assert costs.forward_flops[NORM] > 0 and costs.saved_bytes[NORM] > base.saved_bytes[NORM]
    assert costs.forward_flops[HEAD] == 2 * base.forward_flops[HEAD]
    assert costs.hidden_bytes == 2 * base.hidden_bytes
    from models.pipeline_layers import StagePlan
    from models.tensor_parallel import TensorParallel
    split = StagePlan(parallel=TensorParallel(2), device="meta").multi_token_prediction(config)
    per_rank = LayerCosts(config, Workload(seq_length=16, micro_batch_size=2, tensor_parallel=2))
    base_rank = LayerCosts(plain, Workload(seq_length=16, micro_batch_size=2, tensor_parallel=2))
    assert per_rank.parameters[NORM] - base_rank.parameters[NORM] == sum(p.numel() for p in split.parameters())


# --- training, saving and export ---------------------------------------------------------------------------------

def per_expert(tensors, config):
    """tensors ({hub name: tensor}, experts fused) as DeepSeek-V3's and Qwen3.5-MoE's checkpoints store their MTP
    layer: one tensor per expert and projection."""
    from models.layout import hub_piece, per_expert_pieces
    return {hub: hub_piece(tensor, piece).clone() for name, tensor in tensors.items()
            for hub, piece in per_expert_pieces(name, config) or [(name, None)]}


@pytest.fixture(scope="module")
def mtp_checkpoints(demo_model, tmp_path_factory):
    """family -> the tiny model over the demo model's tokenizer, its checkpoint shipping a whole MTP layer as the
    hub does ({hf, ds, config, mtp: {hub name: tensor, experts fused}}): DeepSeek-V3's (its own norms, projection,
    a sparse decoder layer one tensor per expert, and copies of the embedding and head), Qwen3.5's (mtp.*)."""
    from checkpoints.hf_to_ds import convert_hf_to_ds
    from tests.test_deepseek_conversion import with_mtp_shard
    from tests.test_moe import demo_model_of
    built = {}

    def checkpoint(family):
        if family in built:
            return built[family]
        config = tiny_config(family)
        del config.mtp_loss_scale  # the run's, not the checkpoint's
        root = tmp_path_factory.mktemp(f"mtp_{family}")
        dirs = demo_model_of(config, demo_model, root)
        mtp = mtp_hub_tensors(config)
        weights = with_mtp_shard(dirs["hf"], {})
        copies = {}
        if not config.model_type.startswith("qwen3_5"):
            prefix = f"model.layers.{config.num_hidden_layers}."
            copies = {f"{prefix}embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
                      f"{prefix}shared_head.head.weight": weights["lm_head.weight"].clone()}
        with_mtp_shard(dirs["hf"], {**per_expert(mtp, config), **copies})
        convert_hf_to_ds(dirs["hf"], dirs["ds"], overwrite=True)
        built[family] = {**dirs, "config": config, "mtp": mtp}
        return built[family]
    return checkpoint


def test_qwen3_5_moe_mtp_experts_stack_from_the_hub_and_export_under_their_names(tmp_path):
    """Qwen3.5-MoE's checkpoint stores its decoder layers' experts fused and its MTP layer's one tensor per expert
    (mtp.layers.0.mlp.experts.{e}.*): the carried file's per-expert tensors start the MTP layer stacked, and a
    checkpoint holding a trained MTP layer exports it under the names and dtypes it was stored by, each tensor the
    trained one's bytes; the untrained export is the original checkpoint's bytes."""
    from checkpoints.ds_to_hf import convert_ds_to_hf
    from checkpoints.hf_to_ds import convert_hf_to_ds
    from checkpoints.mtp_tensors import carried_mtp_state
    from models.layout import layer_file_path
    from tests.test_conversion import load_hf_weights
    from tests.test_deepseek_conversion import with_mtp_shard
    config = tiny_config("qwen3_5_moe")
    del config.mtp_loss_scale
    make_model(config, tmp_path / "hf")
    mtp = {name: tensor.to(torch.bfloat16) for name, tensor in mtp_hub_tensors(config).items()}
    stored = per_expert(mtp, config)
    assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in stored and "mtp.layers.0.mlp.experts.gate_up_proj" not in stored
    original = with_mtp_shard(str(tmp_path / "hf"), stored)
    convert_hf_to_ds(str(tmp_path / "hf"), str(tmp_path / "ds"))
    tag = tmp_path / "ds" / "global_step0"
    layout = mtp_layout_of(config)
    state = carried_mtp_state(str(tag), config)
    assert sorted(state) == sorted(MultiTokenPrediction(config).state_dict())
    assert all(torch.equal(state[key], mtp[layout.hub_name(key)]) for key in state)
    convert_ds_to_hf(str(tmp_path / "ds"), str(tmp_path / "untrained"))
    untrained = load_hf_weights(str(tmp_path / "untrained"))
    assert all(torch.equal(untrained[name], tensor) and untrained[name].dtype == tensor.dtype
               for name, tensor in original.items())
    final_norm = layer_file_path(str(tag), config.num_hidden_layers + 1)
    trained = {key: tensor + 1 for key, tensor in state.items()}  # stands for a run's trained layer
    torch.save({**torch.load(final_norm), **{f"mtp.{key}": tensor for key, tensor in trained.items()}}, final_norm)
    convert_ds_to_hf(str(tmp_path / "ds"), str(tmp_path / "out"), verify_checksums=False)
    weights = load_hf_weights(str(tmp_path / "out"))
    expected = per_expert({layout.hub_name(key): tensor for key, tensor in trained.items()}, config)
    assert sorted(name for name in weights if name.startswith("mtp.")) == sorted(stored)
    assert all(torch.equal(weights[name], tensor) and weights[name].dtype == torch.bfloat16
               for name, tensor in expected.items())


@pytest.fixture(scope="module")
def demo_deepseek_with_mtp(mtp_checkpoints):
    return mtp_checkpoints("deepseek_v3")


def reference_steps(model_dirs, batches, micro_batch_size):
    """(losses, gradient norms before clipping, the MTP layer's final tensors {hub name: tensor}) of transformers'
    model and ReferenceMTP trained together by torch's AdamW, each step's loss the global batch's token-mean
    cross-entropy plus SCALE times the MTP layer's summed loss over the same count, each row's document alone."""
    from transformers import AutoModelForCausalLM

    from tests.test_moe import LEARNING_RATE, MAX_GRAD_NORM
    config = model_dirs["config"]
    model = AutoModelForCausalLM.from_pretrained(model_dirs["hf"], attn_implementation="eager", dtype=torch.float32)
    reference = ReferenceMTP(config, model_dirs["mtp"])
    params = [*model.parameters(), *reference.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses, norms = [], []
    for (input_ids, document_ids, _), labels in batches:
        total_tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
        step_loss = 0.0
        for rows in torch.arange(input_ids.shape[0]).split(micro_batch_size):
            loss = 0.0
            for row in rows:
                real = document_ids[row] != 0
                main, mtp = reference(model, input_ids[row, real][None], labels[row, real][None])
                loss = loss + (main + SCALE * mtp) / total_tokens
            loss.backward()
            step_loss += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    layout = mtp_layout_of(config)
    ours = {reference_key(key): key for key in MultiTokenPrediction(config).state_dict()}
    trained = {layout.hub_name(ours[key]): tensor.detach() for key, tensor in reference.state_dict().items()}
    return losses, norms, trained


TP2_X_EP2 = dict(num_stages=1, tensor_parallel_size=2, expert_parallel_size=2, gradient_accumulation_steps=2,
                 zero_stage=1)
# {layout: (family, processes, settings)}
MTP_LAYOUTS = {"1_process": ("deepseek_v3", 1, dict(num_stages=1, gradient_accumulation_steps=4, zero_stage=0)),
               "2stages_x_2dp": ("deepseek_v3", 4, dict(num_stages=2, gradient_accumulation_steps=2, zero_stage=1)),
               # Qwen3.5's MTP layer on context 2 too: its next token and label after next on the other rank
               "qwen3_5_2stages_x_cp2": ("qwen3_5", 4, dict(num_stages=2, context_parallel_size=2,
                                                            gradient_accumulation_steps=4, zero_stage=0)),
               # the MTP layer's latent attention and shared experts split over 2 ranks, its experts over 2 others
               "tp2_x_ep2": ("deepseek_v3", 4, TP2_X_EP2),
               # Qwen3.5-MoE's: its gated attention (query and gate interleaved per head) and gated shared expert
               # split over 2 ranks, its experts over 2 others
               "qwen3_5_moe_tp2_x_ep2": ("qwen3_5_moe", 4, TP2_X_EP2)}
# layouts whose runs share one start of their processes (training.loop.run on each rank, one run after the other)
SHARED_LAUNCH = ("tp2_x_ep2", "qwen3_5_moe_tp2_x_ep2")


def train_with_mtp(demo_model, model_dirs, train_file, out, procs, settings, **extra):
    from tests.test_deepseek_balancing import train_instruction_steps
    return train_instruction_steps(demo_model, model_dirs, train_file, out, procs, settings,
                                   **{"mtp_loss_scale": SCALE, **extra})


@pytest.fixture(scope="module")
def shared_launch(demo_model, mtp_checkpoints, tmp_path_factory):
    """SHARED_LAUNCH's runs (train_with_mtp's) in one start of 4 processes: {layout: (train_file, output_dir)}."""
    from tests.distributed import spawn
    from tests.test_deepseek_balancing import instruction_overrides
    from tests.test_preference import composed, run_trainer
    from tests.test_token_mean import write_skewed_instructions
    runs, overrides = {}, []
    for layout in SHARED_LAUNCH:
        family, procs, settings = MTP_LAYOUTS[layout]
        assert procs == 4, layout
        root = tmp_path_factory.mktemp(layout)
        runs[layout] = (write_skewed_instructions(demo_model, root / "train.jsonl"), root / "run")
        # the demo tokenizer named: AutoTokenizer maps model_type qwen3_5_moe_text to Qwen3_5Tokenizer whatever
        # tokenizer_config.json says, which would tokenize the run's rows unlike the reference's
        overrides.append(instruction_overrides(demo_model, mtp_checkpoints(family), *runs[layout], settings,
                                               mtp_loss_scale=SCALE, tokenizer_name_or_path=demo_model["hf"]))
    spawn(run_trainer, 4, *composed(*overrides))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", MTP_LAYOUTS)
def test_training_equals_the_reference_and_exports_the_trained_layer(demo_model, mtp_checkpoints, tmp_path, layout,
                                                                     request):
    """Six steps with mtp_loss_scale (padded instruction rows, clipping active) from a converted checkpoint whose MTP
    layer is carried: the MTP layer starts from the carried file, the logged losses and the step-1 gradient norm are
    those of transformers + ReferenceMTP + AdamW (which differ from the main loss's alone), and the export holds
    the trained MTP layer under DeepSeek's names, one tensor per expert, within 1e-5 of the reference's, its copies
    of the embedding and head the exported ones. On 2 stages x 2 data-parallel, the checkpoint of step 3 (its MTP
    layer in the final norm's layer file) resumed on 1 stage x 2 data-parallel trains steps 4 to 6 as the straight
    run did, to the same exported MTP layer."""
    from tests.test_conversion import load_hf_weights
    from tests.test_moe import MAX_GRAD_NORM, TRAIN_STEPS
    from tests.test_token_mean import MICRO_BATCH as ROWS, global_batches, write_skewed_instructions
    from tests.launch import logged_steps
    family, procs, settings = MTP_LAYOUTS[layout]
    demo_deepseek_with_mtp = mtp_checkpoints(family)
    if layout in SHARED_LAUNCH:
        train_file, out = request.getfixturevalue("shared_launch")[layout]
        records = logged_steps(out)
    else:
        train_file = write_skewed_instructions(demo_model, tmp_path / "train.jsonl")
        out = tmp_path / "run"
        records = train_with_mtp(demo_model, demo_deepseek_with_mtp, train_file, out, procs, settings)
    data_parallel = (procs // settings["num_stages"] // settings.get("tensor_parallel_size", 1)
                     // settings.get("context_parallel_size", 1))
    batches = global_batches(demo_model, train_file, data_parallel, settings["gradient_accumulation_steps"],
                             tmp_path / "ref", steps=TRAIN_STEPS)
    losses, norms, trained = reference_steps(demo_deepseek_with_mtp, list(batches), ROWS)
    assert min(norms) > MAX_GRAD_NORM  # clipping acts on every step
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=1e-5, rel=0)
    assert records[0]["grad_norm"] == pytest.approx(norms[0], rel=1e-4)
    config = demo_deepseek_with_mtp["config"]
    weights = load_hf_weights(str(out / "hf"))
    expected = per_expert(trained, config)
    layout_of_mtp = mtp_layout_of(config)
    assert sorted(name for name in weights if name.startswith(layout_of_mtp.prefix)) == \
        sorted([*expected, *(f"{layout_of_mtp.prefix}{copy}" for copy, _ in layout_of_mtp.shared)])
    errors = {name: (weights[name] - tensor).abs().max().item() for name, tensor in expected.items()}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda item: -item[1])[:5]
    moved = {name: (tensor - per_expert(demo_deepseek_with_mtp["mtp"], config)[name]).abs().max().item()
             for name, tensor in expected.items()}
    # every MTP tensor trained, but the router's correction bias (a buffer) and experts no token chose
    assert all(moved[name] > 1e-4 for name in moved if not ("experts." in name or "correction_bias" in name)), moved
    for copy, source in layout_of_mtp.shared:  # DeepSeek-V3's copies of the shared embedding and head
        assert torch.equal(weights[f"{layout_of_mtp.prefix}{copy}"], weights[source])
    if layout != "2stages_x_2dp":
        return
    resumed = train_with_mtp(demo_model, demo_deepseek_with_mtp, train_file, tmp_path / "resumed", 2,
                             dict(settings, num_stages=1), resume=str(out / "global_step3"))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records[3:]], abs=1e-5, rel=0)
    resumed_weights = load_hf_weights(str(tmp_path / "resumed" / "hf"))
    assert all(torch.allclose(resumed_weights[name], weights[name], rtol=0, atol=1e-5) for name in expected)


@pytest.mark.parametrize("model,overrides,message", [
    ("llama", ["mtp_loss_scale=0.1"], r"^mtp_loss_scale > 0: model_type 'llama' has no multi-token-prediction layer "
                                      r"the pipeline trains \(those of deepseek_v3, glm4_moe, qwen3_5_text, "
                                      r"qwen3_5_moe_text\); set mtp_loss_scale=0\.$"),
    ("deepseek_v3", ["mtp_loss_scale=0.1"], r"^mtp_loss_scale > 0: \S+global_step0 carries no "
                                            r"multi-token-prediction tensors \(under model\.layers\.4\.\) to start "
                                            r"the MTP layer from; convert the checkpoint again"),
    ("deepseek_v3_mtp", ["mtp_loss_scale=-1"], r"^mtp_loss_scale=-1 must be a number >= 0"),
    ("deepseek_v3_mtp", ["mtp_loss_scale=0.1", "lora.rank=4"], r"^lora\.rank=4 with mtp_loss_scale=0\.1: a LoRA run "
                                                              r"exports a peft adapter of transformers' model, which "
                                                              r"has no MTP layer"),
], ids=["no_mtp_family", "none_carried", "negative", "lora"])
def test_mtp_settings_are_refused_where_they_do_not_apply(demo_model, tiny_deepseek_checkpoints, mtp_checkpoints,
                                                          tmp_path, model, overrides, message):
    from tests.test_moe import run_spec_of
    from training.config_checks import ConfigError
    model_dir = {"llama": lambda: demo_model["ds"], "deepseek_v3": lambda: tiny_deepseek_checkpoints["deepseek_v3"][1],
                 "deepseek_v3_mtp": lambda: mtp_checkpoints("deepseek_v3")["ds"]}[model]()
    with pytest.raises(ConfigError, match=message):
        run_spec_of(demo_model, model_dir, tmp_path, *overrides)


def test_the_scale_reaches_the_model_config(demo_model, demo_deepseek_with_mtp, tmp_path):
    from tests.test_moe import run_spec_of
    assert run_spec_of(demo_model, demo_deepseek_with_mtp["ds"], tmp_path,
                       "mtp_loss_scale=0.1").model_config.mtp_loss_scale == 0.1
    assert not hasattr(run_spec_of(demo_model, demo_deepseek_with_mtp["ds"], tmp_path).model_config,
                       "mtp_loss_scale")
