"""M-RoPE position ids without the language model: transformers' own ``get_rope_index``.

``get_rope_index`` is a method of the ``Qwen*VLModel`` but only reads ``self.config`` and calls
``self.get_vision_position_ids``; we call it on a small host object carrying just those two, so
positions are exactly transformers' while no model (not even on the meta device) is built.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from .checkpoint import MODEL_CLASS, Checkpoint


class RopeIndexer:
    def __init__(self, checkpoint: Checkpoint) -> None:
        model_cls = checkpoint.model_class(MODEL_CLASS)
        host = types.SimpleNamespace(config=checkpoint.config)
        host.get_vision_position_ids = types.MethodType(model_cls.get_vision_position_ids, host)
        self._get_rope_index = types.MethodType(model_cls.get_rope_index, host)

    def positions(
        self,
        input_ids: np.ndarray,
        mm_types: np.ndarray,
        grids: list[tuple[int, int, int]],
        video_grids: list[tuple[int, int, int]] = (),
        second_per_grid_ts: list[float] = (),
    ) -> tuple[np.ndarray, int]:
        """(positions int32 [3, L], mrope_delta) for one prompt. ``mm_types``: 0 text, 1 image,
        2 video per token; ``grids`` the images', ``video_grids`` the videos' (whole videos,
        ``(frame groups, h, w)``), ``second_per_grid_ts`` each video's seconds per frame group
        (read by Qwen2.5-VL only)."""
        ids = torch.from_numpy(input_ids.astype(np.int64))[None]
        types = torch.from_numpy(mm_types.astype(np.int64))[None]
        grid_thw = torch.tensor(grids, dtype=torch.long) if grids else None
        kwargs = {}
        if video_grids:
            kwargs["video_grid_thw"] = torch.tensor(list(video_grids), dtype=torch.long)
            kwargs["second_per_grid_ts"] = torch.tensor(list(second_per_grid_ts))
        with torch.no_grad():
            pos, delta = self._get_rope_index(ids, types, image_grid_thw=grid_thw, **kwargs)
        return pos[:, 0].numpy().astype(np.int32), int(delta.reshape(-1)[0])
