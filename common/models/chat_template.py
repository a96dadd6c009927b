"""The VL chat template written into generated checkpoints.

The Qwen-VL format: ChatML turns, a default system turn, and each image rendered as
``<|vision_start|><|image_pad|><|vision_end|>`` where the image part stands in the content list
(a video ``<|vision_start|><|video_pad|><|vision_end|>``). The encoder later expands each single
``<|image_pad|>`` / ``<|video_pad|>`` to the item's tokens.
"""

from __future__ import annotations

QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{%- endif -%}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
