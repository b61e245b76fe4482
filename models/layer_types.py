"""What a decoder layer's attention takes from its layer type, for the families whose config lists `layer_types`
('sliding_attention' or 'full_attention' per layer) with rotary parameters per type (Gemma 3, Gemma 4, OLMo 3): the
masks of each type's window; the rotary tables of each type are models/rotary.py's RotaryByLayerType.

The tables and masks are built once per micro-batch for every type a stage holds, not once per layer, and handed to
each layer with its type's (models/attention.py StageAttentionInputs); a layer never builds its own.
"""
from models.attention import document_causal_mask, within_window
from models.attention_kernels import additive_mask

def layer_windows(config):
    """{layer type: its attention window (keys > query - window), None for the whole sequence}."""
    return {layer_type: config.sliding_window if layer_type == "sliding_attention" else None
            for layer_type in set(config.layer_types)}


def masks_by_layer_type(document_ids, windows, dtype, packed=True):
    """{layer type: the additive mask of its window, or None for plain causal attention}.

    document_ids (batch, seq): 0 on padding, k >= 1 on a row's k-th document. packed: the rows may hold several
    documents, so each type takes the document mask; else (one document then padding, as transformers' padded
    rows) the full layers attend causally with no mask, which computes every real token as the padding mask would,
    and a window shorter than the row takes its band."""
    allowed = document_causal_mask(document_ids) if packed else None
    return {layer_type: additive_mask(within_window(allowed, window, document_ids), dtype)
            for layer_type, window in windows.items()}
