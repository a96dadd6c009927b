"""Requests, scheduling, sampling and the engine loop (schedule -> run -> postprocess)."""
