"""The LM head on the native bf16 kernel (``common/native_lm_head.c``): logits, or each row's
greedy choice without the logits.

A decode step's head is a few rows against the whole vocabulary: on a CPU it reads the weight
once and is bound by that read, and a step whose rows are all greedy needs only each row's
maximum. ``maxima`` finds it while the logits are made, so the ``[rows, vocab]`` logits are
neither written nor read back by a reduction. Measured on 2 cores (Zen 4, bf16, 16 rows; oneDNN's
prepacked linear then ``row_max``): the demo head (256 x 151,669) 4.9 -> 2.9 ms, Qwen2.5-VL-3B's
(2,048 x 151,936) 29 -> 24 ms. A logit is its float32 sum rounded to bf16, as a bf16 matrix
product's is; the sums run in another order than oneDNN's, so a logit may differ from its one
bf16 step (tested against float32 as oneDNN's are).

Where the CPU has AVX-512 VNNI too, ``maxima`` first reads an int8 copy of the weight
(``NativeKernels.lm_head_screened``), quantized in groups of 128 dimensions on both sides: half
the bytes and twice the products per instruction give each column an interval sure to hold its
logit, and only the blocks of 16 columns whose interval reaches the best lower end are run
through the bf16 pass, each read once for all the rows that kept it, so the answer is the full
pass's, bit for bit. On Qwen2.5-VL-3B's widths with random weights (2 cores, Zen 4) a row keeps
about 100-130 of 9,496 blocks and sixteen rows about a fifth of them together: the head takes
17 ms instead of 24.5 (the screen 13, the blocks rechecked 4); at one row 9 ms instead of 13-19.
The blocks a call reads grow with its rows (``1 - (1 - p)^rows`` of them where each row keeps
``p`` of the blocks independently), and the screen stops paying where they near the whole head: it
runs while that share is at most ``SCREEN_SHARE``, from a running count of the blocks a row
keeps, and tries again every ``SCREEN_RETRY`` calls after it stopped. The copy costs ``vocab x
hidden`` bytes (39 MB for the demo, 311 MB at 3B widths).
"""

from __future__ import annotations

import torch
from torch import nn

from common.native_kernels import LM_HEAD_COLS, NativeKernels

# screened while a call's rows would recheck at most this share of the head's blocks: the screen
# costs about half the full pass, a block it rechecks about what the full pass spends on one
SCREEN_SHARE = 0.5
# calls between tries of the screen after the running count stopped it
SCREEN_RETRY = 256
# weight of a call in the running count of blocks a row rechecks
SCREEN_DECAY = 0.1


class NativeLMHead(nn.Module):
    """``y = x @ W.T`` for ``W`` [vocab, hidden] (bf16), packed once for the native kernel."""

    def __init__(self, weight: torch.Tensor, native: NativeKernels) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.native = native
        packed = native.pack_lm_head(weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        self.screen = native.pack_lm_head_screen(weight.detach())  # None: no screen here
        self.blocks = -(-self.out_features // LM_HEAD_COLS)
        self.rechecked_per_row = 0.0  # running count of the blocks a screened row rechecks
        self.calls_unscreened = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] (bf16) of ``h`` [n, hidden]."""
        return self.native.lm_head_logits(h, self.packed_weight, self.out_features)

    def maxima(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's largest logit (float32 [n]; NaN where a logit is NaN or +inf) and the first
        token holding it (long [n])."""
        rows = h.shape[0]
        if self.screen is None or rows == 0:
            return self.native.lm_head_maxima(h, self.packed_weight, self.out_features)
        kept = min(self.rechecked_per_row / self.blocks, 1.0)  # the share of blocks a row keeps
        fits = 1.0 - (1.0 - kept) ** rows <= SCREEN_SHARE
        if not fits:
            self.calls_unscreened += 1
            if self.calls_unscreened < SCREEN_RETRY:
                return self.native.lm_head_maxima(h, self.packed_weight, self.out_features)
        self.calls_unscreened = 0
        values, indices, rechecked = self.native.lm_head_screened(
            h, self.packed_weight, self.screen, self.out_features
        )
        if rechecked is None:  # it gave up (a row it cannot bound, too many columns): stop
            self.rechecked_per_row = float(self.blocks)
        elif not fits:  # a try after it stopped: taken as it is
            self.rechecked_per_row = rechecked / rows
        else:
            self.rechecked_per_row += SCREEN_DECAY * (rechecked / rows - self.rechecked_per_row)
        return values, indices

    def extra_repr(self) -> str:
        screened = ", screened in int8" if self.screen is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, native{screened}"
