"""peft on transformers, the reference LoRA runs are compared with: the same adapters on the Hugging Face model."""
import torch
from transformers import AutoModelForCausalLM

from checkpoints.ds_to_hf import PEFT_PREFIX
from models.architecture import architecture_of
from models.layout import fuse, hf_name_of_layer_key
from models.lora import EXPERT_PARAMETERS, add_adapters, expert_ranks, is_adapter_key, peft_adapters
from models.pipeline_layers import decoder_pipe
from models.tensor_parallel import shard_of


def hf_name_of_peft(name):
    """base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> model.layers.0.…lora_A.weight"""
    return name.removeprefix(PEFT_PREFIX).replace(".default.", ".")


def adapter_values(config, settings, seed, nonzero_b=False):
    """{the pipeline's HF name of each adapter factor: its whole initial value}: the trainer's (models/lora.py: each
    decoder layer built with its adapters), or with B drawn at random too (nonzero_b), so that a single step's
    gradients reach A."""
    values = {}
    for layer in range(config.num_hidden_layers):
        decoder = decoder_pipe(config)(config, stage_inputs=None, layer_index=layer)
        add_adapters(decoder, settings, config, seed=seed, index=layer + 1)
        values.update({hf_name_of_layer_key(layer + 1, key, config.num_hidden_layers): value.detach()
                       for key, value in decoder.state_dict().items() if is_adapter_key(key)})
    if nonzero_b:
        for position, name in enumerate(sorted(values)):
            if ".lora_B" in name:
                generator = torch.Generator().manual_seed(seed * 1009 + position)
                values[name] = torch.randn(values[name].shape, generator=generator) * 0.1
    return values


def pipeline_layout(adapters, config, settings):
    """peft_adapters' inverse: {the pipeline's HF name: tensor} of {peft's name: tensor} (gradients), an expert
    adapter's A [E x rank, in] as [E, rank, in] and B [out, rank x E] as [E, out, rank]."""
    ranks = expert_ranks(config, settings.target_modules, settings.rank)
    targeted = [name for name in EXPERT_PARAMETERS if name in ranks]
    renames = {}
    for layer in range(config.num_hidden_layers):
        module = f"model.layers.{layer}.mlp.experts"
        for position, name in enumerate(targeted):
            for factor in ("lora_A", "lora_B"):
                nested = "base_layer." * (len(targeted) - 1 - position)
                renames[f"{module}.{nested}{factor}.weight"] = (f"{module}.{factor}.{name}", factor, ranks[name])
    experts = architecture_of(config).moe.num_experts if targeted else 0
    layout = {}
    for name, tensor in adapters.items():
        if name not in renames:
            layout[name] = tensor
            continue
        pipeline_name, factor, rank = renames[name]
        layout[pipeline_name] = tensor.view(experts, rank, -1) if factor == "lora_A" else \
            tensor.view(tensor.shape[0], rank, experts).permute(2, 0, 1)
    return layout


def peft_model(hf_dir, settings, values):
    """The Hugging Face model (fp32, eager attention) with peft adapters set to `values` (adapter_values)."""
    from peft import get_peft_model
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    model = get_peft_model(model, settings.peft_config(model.config))
    values = fuse(peft_adapters(values), model.config)  # Phi-3's adapters on its fused projections; the experts' too
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(values[hf_name_of_peft(name)])
    return model


def pipeline_slice(value, param, rank, size):
    """This tensor-parallel rank's slice of a whole adapter value (split like models/lora.py splits it)."""
    dim = getattr(param, "tensor_parallel_dim", None)
    return value if dim is None or size == 1 else shard_of(value, dim, rank, size,
                                                            getattr(param, "tensor_parallel_blocks", None))



def peft_training_losses(hf_dir, train_file, tokenizer_dir, settings, steps, seed, seq_length, micro_batch_size,
                         micro_batches, learning_rate, betas, eps, max_grad_norm, cache_dir):
    """Per-step mean losses of a plain single-process loop: peft on transformers, torch's AdamW on the adapters
    (starting from the trainer's initial values), gradients clipped to max_grad_norm, on the micro-batches one
    data-parallel rank of the trainer reads (the trainer's loader with the same seed)."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    from data.datasets import build_dataset
    from data.loader import build_stage_loader, infinite_micro_batches
    from training.run_data import pad_token_id
    from training.config_checks import BASE_CONFIG

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data_cfg = OmegaConf.load(BASE_CONFIG).data
    dataset, _ = build_dataset(train_file, tokenizer, data_cfg, seq_length, cache_dir=cache_dir)
    config = AutoConfig.from_pretrained(hf_dir)
    stream = infinite_micro_batches(build_stage_loader(
        dataset, reads_data=True, dp_rank=0, dp_size=1, micro_batch_size=micro_batch_size, seq_length=seq_length,
        pad_id=pad_token_id(tokenizer, config), seed=seed))
    model = peft_model(hf_dir, settings, adapter_values(config, settings, seed))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=learning_rate, betas=betas, eps=eps, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        step_losses = []
        for _ in range(micro_batches):
            (input_ids, document_ids, position_ids), labels = next(stream)
            loss = model(input_ids=input_ids, attention_mask=(document_ids != 0).long(), position_ids=position_ids,
                         labels=labels).loss
            (loss / micro_batches).backward()
            step_losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses) / micro_batches)
    return losses, model


def hf_eval_loss(model, eval_file, tokenizer_dir, seq_length, cache_dir):
    """The trainer's eval_loss (evaluation/eval_set.py) computed by a Hugging Face (or peft) model: every example's
    mean loss weighted by its labelled tokens."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from data.collator import collate_causal_lm
    from data.datasets import build_dataset
    from models.loss import labelled_tokens
    from training.config_checks import BASE_CONFIG

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dataset, _ = build_dataset(eval_file, tokenizer, OmegaConf.load(BASE_CONFIG).data, seq_length,
                               cache_dir=cache_dir)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for example in dataset:
            (input_ids, document_ids, position_ids), labels = collate_causal_lm([example], seq_length, pad_id=0)
            count = int(labelled_tokens(labels))
            loss = model(input_ids=input_ids, attention_mask=(document_ids != 0).long(), position_ids=position_ids,
                         labels=labels).loss
            total, tokens = total + loss.item() * count, tokens + count
    return total / tokens
