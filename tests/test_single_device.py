"""The single-device model (`from models import from_hf`, models/causal_lm.py) against transformers, family by
family: the same logits and loss on a padded batch, read from sharded safetensors and from .bin files."""
import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import DEEPSEEK_CONFIGS, MOE_CONFIGS, TINY_CONFIGS, make_batch, make_tiny_model

FAMILIES = [*TINY_CONFIGS, *MOE_CONFIGS, *DEEPSEEK_CONFIGS]


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
