"""What the parity tests of the per-layer-type families' parts (tests/test_gemma_parts.py, tests/test_olmo3_parts.py)
share: the rows they run (full, padded, packed), transformers' logits for them, a loss that reads every logit, and
the tolerance checks."""
import torch
from transformers import AutoModelForCausalLM

VOCAB, BATCH, SEQ = 96, 2, 12
# Float64 runs against each document alone (tests/test_gemma_parts.py says why float64): SDPA's to float64's
# rounding, the gradients to the fp32 sums inside the norms. Eager attention's softmax is fp32 in both (as in
# transformers' eager_attention_forward), forward and backward, and an fp32 softmax rounds a row by where its values
# fall in the vector lanes: on AVX2 kernels a 5-token document alone and inside a 12-wide packed row differ by
# 1.2e-7 of a weight, up to 1.8e-6 of these models' logits and 1.4e-5 of a gradient (AVX-512's 16 lanes hold a whole
# row: 1e-15); a token of one document seen by another moves them by tenths.
DOCUMENTS_ALONE_TOLERANCES = {"sdpa": dict(logits_tol=1e-12, grads_tol=1e-5),
                              "eager": dict(logits_tol=1e-5, grads_tol=1e-4)}


def close(ours, theirs, tol=1e-5):
    """Within tol of transformers, relative to its largest magnitude where that exceeds 1."""
    return (ours - theirs).abs().max().item() <= tol * max(1.0, theirs.abs().max().item())


def rows(layout):
    """(input_ids, document_ids, position_ids) of two rows: full (one document each), padded (the second row ends
    in padding), or packed (the first row two documents and padding, the second three documents)."""
    torch.manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    document_ids = torch.ones(BATCH, SEQ, dtype=torch.long)
    if layout == "padded":
        document_ids[1, 8:] = 0
    elif layout == "packed":
        document_ids[0, 5:10], document_ids[0, 10:] = 2, 0
        document_ids[1, 3:9], document_ids[1, 9:] = 2, 3
    input_ids[document_ids == 0] = 0  # the pad token
    position_ids = torch.zeros_like(document_ids)
    for row in range(BATCH):
        for document in document_ids[row].unique():
            where = document_ids[row] == document
            position_ids[row, where] = torch.arange(int(where.sum()))
    return input_ids, document_ids, position_ids


def documents(document_ids):
    """[(row, positions)] of every real document."""
    found = []
    for row in range(document_ids.shape[0]):
        for document in document_ids[row].unique().tolist():
            if document:
                found.append((row, (document_ids[row] == document).nonzero().squeeze(1)))
    return found


def reference_logits(hf_model, input_ids, document_ids, position_ids, layout):
    """transformers' logits at every real token, zeros elsewhere: padded rows with their attention mask; packed
    rows through transformers' own packing (position ids restarting at each document, no attention mask and no
    cache: it then masks each document apart); 'documents': each document of a packed row run alone."""
    real = (document_ids != 0)[..., None]
    if layout == "packed":
        return hf_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits * real
    if layout != "documents":
        return hf_model(input_ids=input_ids, attention_mask=(document_ids != 0).long(), use_cache=False).logits * real
    logits = torch.zeros(*input_ids.shape, hf_model.config.vocab_size, dtype=hf_model.dtype)
    for row, where in documents(document_ids):
        alone = hf_model(input_ids=input_ids[row, where][None], use_cache=False).logits[0]
        logits = logits.index_put((torch.tensor(row), where), alone)
    return logits


def loss_of(logits, document_ids):
    """A loss reading every real token's logits with its own weight (fixed), so every gradient path is exercised."""
    torch.manual_seed(2)
    weights = torch.randn(logits.shape) * (document_ids != 0)[..., None]
    return (logits * weights).sum()


def hf_grads(hf_model):
    return {name.removeprefix("model."): p.grad for name, p in hf_model.named_parameters() if p.grad is not None}


def check_grads(ours, theirs, tol=1e-5):
    assert ours.keys() == theirs.keys(), set(ours) ^ set(theirs)
    wrong = [name for name in theirs if not close(ours[name], theirs[name], tol)]
    assert not wrong, wrong


def reloaded(hf_model, dtype, directory):
    """transformers' model saved and loaded back in dtype, as a user loads a checkpoint: its parameters in dtype,
    the buffers transformers keeps in fp32 (rotary frequencies, embedding scales) still fp32, as `.to(dtype)` would
    not leave them."""
    hf_model.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
                                                attn_implementation=hf_model.config._attn_implementation).eval()
