"""The text decoder of Qwen2-VL / Qwen2.5-VL / Qwen3-VL, run over a paged KV pool."""
