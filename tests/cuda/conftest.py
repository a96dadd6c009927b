"""What the CUDA tests share: the device, the dtypes, the archs and transformers on the GPU."""

from __future__ import annotations

import pytest
import torch

from common.models.hf_reference import HFReference
from tests.conftest import ARCHS

CUDA = "cuda"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def refs(arch, tiny_model_dir):
    """transformers on the GPU, in each dtype."""
    path = tiny_model_dir(arch)
    return {name: HFReference(path, device=CUDA, dtype=dtype) for name, dtype in DTYPES.items()}
