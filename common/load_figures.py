"""The figures a worker reports about itself to the gateway: one table both sides use.

A self-registered worker heartbeats ``load_figures(reply)`` and ``descriptor(reply)`` of its own
``GetLoad`` reply; the gateway's poll of a static worker computes the same from the same reply.
So routing and ``ListWorkers`` read one set of keys whatever the source.
"""

from __future__ import annotations

from protos.epd.v1 import encoder_pb2, language_pb2

# load key -> field of the role's GetLoad reply
ENCODER_FIGURES = {
    "queue_depth": "num_queued_requests",
    "queued_images": "num_queued_images",
    "waiting_for_blocks": "num_waiting_for_blocks",
    "free_blocks": "free_blocks",
}
LANGUAGE_FIGURES = {
    "running": "num_running",
    "waiting": "num_waiting",
    "receiving": "num_receiving",
    "kv_slots_used": "num_kv_slots_used",
    "kv_slots_total": "num_kv_slots_total",
}

LoadReply = encoder_pb2.LoadReport | language_pb2.LanguageLoad


def load_figures(reply: LoadReply) -> dict[str, float]:
    """The load figures (``HeartbeatRequest.load``) of an encoder's or a language worker's
    ``GetLoad`` reply."""
    table = ENCODER_FIGURES if isinstance(reply, encoder_pb2.LoadReport) else LANGUAGE_FIGURES
    return {key: float(getattr(reply, name)) for key, name in table.items()}


def descriptor(reply: LoadReply) -> dict:
    """What a worker says about its shape (the ``HeartbeatRequest`` fields beside the load):
    its transfer layout and the longest prompt (encoder) or sequence (language) it takes."""
    out: dict = {"transfer_layout": reply.transfer_layout}
    if isinstance(reply, encoder_pb2.LoadReport):
        out["max_prompt_tokens"] = reply.max_prompt_tokens
    else:
        out["max_seq_len"] = reply.max_seq_len
    return out
