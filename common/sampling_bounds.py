"""Bounds of the logits controls and of ``n``, shared by the gateway's validation, the HTTP
schema and the language worker's ``SamplingParams``, so that every layer refuses the same
values."""

from __future__ import annotations

MAX_ABS_PENALTY = 2.0  # frequency_penalty and presence_penalty lie in [-2, 2]
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, 10]; 1 = off
MAX_ABS_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # token ids one request may bias
MAX_N = 16  # choices one request may ask for (``n``): each its own sequence on the worker
