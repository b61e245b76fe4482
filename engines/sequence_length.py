"""A sequence length that may change between steps (length-bucketed data, an evaluation set of another length).

DeepSpeed's pipeline engine sends the shapes between stages once, before its first activation send, and sizes its
receive and gradient buffers from them; the zero-bubble engine receives into the same shapes, and the chunked engine
sends each chunk boundary's shapes once (engines/chunked_engine.py). All of them keep those shapes until told
otherwise: DeepSpeed's `reset_activation_shape` (its own hook for curriculum learning, which the chunked engine
extends) makes each send the shapes again at its next first send. Every rank of a pipeline must reset together, so
each calls `use_sequence_length` with the same length before every train_batch and eval_batch: the training loop
with the step's (training/token_mean.py step_totals agrees it over the job in the step's one all-reduce), evaluation
with its rows'. Nothing happens while the length stays, so a run of one length sends its shapes once, as before.
"""


def use_sequence_length(engine, length):
    """Rows of `length` positions as the stages hold them (under context parallelism each rank's share) from the
    next step on: the engine's shapes and buffers are made again when it differs from the last step's."""
    if getattr(engine, "sequence_length", length) != length:
        engine.reset_activation_shape()
    engine.sequence_length = length
