"""The single-device model (`from models import from_hf`, models/causal_lm.py) against transformers, family by
family: the same logits and loss on a padded batch, read from sharded safetensors and from .bin files."""
import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import (DEEPSEEK_CONFIGS, HYBRID_CONFIGS, MOE_CONFIGS, TINY_CONFIGS, make_batch,
                               make_tiny_model)

FAMILIES = [*TINY_CONFIGS, *MOE_CONFIGS, *DEEPSEEK_CONFIGS, *HYBRID_CONFIGS]


def next_token_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_loss_equal_transformers(name, tmp_path):
    from models import from_hf
    reference = make_tiny_model(name, tmp_path, max_shard_size="20KB")
    model = from_hf(str(tmp_path))
    assert isinstance(model, torch.nn.Module) and not model.training
    input_ids, attention_mask, labels = make_batch(3, 16, reference.config.vocab_size, seed=1)
    with torch.no_grad():
        theirs = reference(input_ids, attention_mask=attention_mask, labels=labels)
        logits = model(input_ids, attention_mask)
    real = attention_mask.bool()
    assert (logits - theirs.logits)[real].abs().max().item() < 1e-5, name
    # transformers' loss adds the load-balancing term where the config asks for it: its next-token part is compared
    aux = getattr(theirs, "aux_loss", None)
    their_loss = theirs.loss - reference.config.router_aux_loss_coef * aux if aux is not None else theirs.loss
    assert next_token_loss(logits, labels).item() == pytest.approx(their_loss.item(), abs=1e-5), name


@pytest.mark.parametrize("name", ["phi3", "mixtral"])  # fused projections; experts as transformers holds them
def test_reads_sharded_bin_weights_and_rows_without_padding(name, tmp_path):
    from models import from_hf
    from tests.test_conversion import save_as_bin
    reference = make_tiny_model(name, tmp_path / "safetensors")
    save_as_bin(reference, str(tmp_path / "bin"), shards=2)
    input_ids = make_batch(2, 12, reference.config.vocab_size, seed=2)[0]
    with torch.no_grad():
        assert (from_hf(str(tmp_path / "bin"))(input_ids) - reference(input_ids).logits).abs().max().item() < 1e-5


def packed_row(lengths, vocab_size, seed=0):
    """One row of documents of `lengths` then padding to 160 (input ids, document ids, positions restarting at each
    document), and each document's (start, end)."""
    gen = torch.Generator().manual_seed(seed)
    ids, documents, positions, spans, start = [], [], [], [], 0
    for number, length in enumerate(lengths, 1):
        ids.append(torch.randint(0, vocab_size, (length,), generator=gen))
        documents.append(torch.full((length,), number))
        positions.append(torch.arange(length))
        spans.append((start, start + length))
        start += length
    padding = 160 - start
    ids.append(torch.zeros(padding, dtype=torch.long))
    documents.append(torch.zeros(padding, dtype=torch.long))
    positions.append(torch.arange(padding))
    return torch.cat(ids)[None], torch.cat(documents)[None], torch.cat(positions)[None], spans


@pytest.mark.parametrize("name", HYBRID_CONFIGS)
def test_packed_documents_each_equal_transformers_alone(name, tmp_path):
    """Documents of 70, 9 and 75 tokens packed in a row of 160 (each document's first, crossing the delta rule's
    chunks of 64): the recurrent state and the convolution's window restart at every document, so each document's
    logits and loss are transformers' on that document alone (which transformers' torch path cannot compute
    packed)."""
    from models import from_hf
    reference = make_tiny_model(name, tmp_path)
    model = from_hf(str(tmp_path))
    input_ids, document_ids, positions, spans = packed_row([70, 9, 75], reference.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids, document_ids=document_ids, position_ids=positions)
        for start, end in spans:
            alone = reference(input_ids[:, start:end], labels=input_ids[:, start:end])
            assert (logits[:, start:end] - alone.logits).abs().max().item() < 1e-5, (name, start)
            loss = next_token_loss(logits[:, start:end], input_ids[:, start:end])
            aux = getattr(alone, "aux_loss", None)
            their_loss = alone.loss - reference.config.router_aux_loss_coef * aux if aux is not None else alone.loss
            assert loss.item() == pytest.approx(their_loss.item(), abs=1e-5), (name, start)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_multimodal_checkpoint_trains_its_text_model(moe, tmp_path):
    """Qwen3.5's multimodal checkpoint as the hub ships it (model.language_model.*, model.visual.*, mtp.*): the
    single-device model is its text model, equal to transformers' multimodal model on text."""
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)
    from models import from_hf
    from tests.hub_checkpoints import QWEN_VISION, hf_weights, mtp, rewrite_shards
    text = HYBRID_CONFIGS["qwen3_5_moe" if moe else "qwen3_5"]().to_dict()
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, vision_config=QWEN_VISION)
    torch.manual_seed(0)
    reference = (Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration)(config).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(std=0.1)
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    rewrite_shards(tmp_path, {**hf_weights(tmp_path), **mtp(dtype=torch.float32)})
    model = from_hf(str(tmp_path))
    assert model.config.model_type == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    input_ids, attention_mask, _ = make_batch(2, 16, config.text_config.vocab_size, seed=3)
    with torch.no_grad():
        theirs = reference(input_ids=input_ids, attention_mask=attention_mask).logits
        ours = model(input_ids, attention_mask)
    assert (ours - theirs)[attention_mask.bool()].abs().max().item() < 1e-5


@pytest.mark.parametrize("model_type", ["kimi_linear", "olmo_hybrid"])
def test_an_unsupported_hybrid_is_refused_naming_it_and_the_supported(model_type):
    from transformers import PretrainedConfig
    from models.architecture import SUPPORTED_MODEL_TYPES, check_model_config
    config = PretrainedConfig()
    config.model_type = model_type
    with pytest.raises(ValueError) as error:
        check_model_config(config)
    message = str(error.value)
    assert "\n" not in message and f"'{model_type}' is not supported" in message
    assert all(supported in message for supported in SUPPORTED_MODEL_TYPES)
    assert "qwen3_5_text" in SUPPORTED_MODEL_TYPES and "qwen3_next" in SUPPORTED_MODEL_TYPES


def test_an_unknown_layer_type_is_refused_naming_it():
    from models.architecture import check_model_config
    config = HYBRID_CONFIGS["qwen3_5"]()
    config.layer_types = ["linear_attention", "mamba", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['mamba'\].*implemented: full_attention, linear_attention"):
        check_model_config(config)
