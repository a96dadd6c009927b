"""Compute dtype and device chosen independently; rows leave the encoder in the wire dtype."""

from __future__ import annotations

import argparse
import itertools

import pytest
import torch
from encoder_helpers import encode_bytes, noise_image, user_turn

from common.compute import resolve_compute
from common.models.hf_reference import HFReference
from common.models.tiny import ARCHS
from common.transfer.config import TransferConfig
from common.transfer.receiver import EmbeddingReceiver
from services.encoder.config import EncoderConfig
from services.encoder.pipeline import EncoderPipeline
from services.encoder.server import add_arguments, config_from_args
from services.encoder.service import EncoderService
from services.encoder.types import ChatMessage, ContentPart, EncodeRequest, ImageSource
from services.encoder.vision import to_host

_rooms = itertools.count(500)
ONEDNN_TOL = 0.01  # two bf16 steps (2**-8 relative each) at the rows' largest magnitude


def test_device_and_dtype_are_independent(monkeypatch):
    def pick(device, dtype, flags=frozenset()):
        compute = resolve_compute(device, dtype, flags)
        return compute.device, compute.dtype

    assert pick("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert pick("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert pick("cpu", "float16") == (torch.device("cpu"), torch.float16)
    if torch.cuda.is_available():
        assert pick("auto", "auto") == (torch.device("cuda", 0), torch.bfloat16)
        assert pick("cuda", "float32") == (torch.device("cuda", 0), torch.float32)
    else:
        assert pick("auto", "auto") == (torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="cuda:64 requested but"):
        pick("cuda:64", "auto")
    for bad in ({"device": "gpu"}, {"device": "cuda:x"}, {"dtype": "int8"}, {"dtype": "fp8"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EncoderConfig(**bad)
    assert EncoderConfig(device="cuda:1", dtype="float16").device == "cuda:1"
    monkeypatch.setenv("EPD_ENCODER_DTYPE", "bfloat16")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--model-path", "m"])).dtype == "bfloat16"
    args = parser.parse_args(["--model-path", "m", "--dtype", "float16", "--device", "cpu"])
    assert config_from_args(args).dtype == "float16"


def test_to_host_casts_once_into_a_tensor_of_its_own():
    batch = torch.randn(10, 8)
    part = batch[2:5]
    same = to_host(part, torch.float32)
    assert torch.equal(same, part) and same.data_ptr() != part.data_ptr()
    cast = to_host(part, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, part.to(torch.bfloat16))
    assert cast.is_contiguous() and cast.untyped_storage().nbytes() == 3 * 8 * 2


def _request(room: int, png: bytes) -> EncodeRequest:
    content = (ContentPart(image=ImageSource("data", png)), ContentPart(text="What is it?"))
    return EncodeRequest(room, f"r{room}", (ChatMessage("user", content),))


@pytest.mark.parametrize(
    ("compute", "wire"),
    [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("bfloat16", "float32")],
)
def test_shipped_rows_are_the_vit_output_cast_to_the_wire_dtype(model_dirs, compute, wire):
    """A real sender and receiver (Mooncake over tcp): the bytes that land on the language side
    are exactly the encoder's own ViT output cast once to the wire dtype (Qwen3-VL: with its
    deepstack rows)."""
    transfer = TransferConfig(dtype=wire, transport="mooncake", num_blocks=16)
    config = EncoderConfig(device="cpu", dtype=compute, cache_mb=0, transfer=transfer)
    service = EncoderService(model_dirs["qwen3_vl"], config)
    receiver = EmbeddingReceiver(transfer, service.layout)
    try:
        img = noise_image(100, 80, 3)
        tower = service.pipeline.tower
        assert tower.dtype == getattr(torch, compute)
        prepared = service.pipeline.preprocessor.prepare(img)
        own = tower.forward(prepared.pixel_values, [prepared.grid_thw])
        expected = own.to(getattr(torch, wire))

        room = next(_rooms)
        receiver.add_room(room, service.sender.endpoint)
        service.accept(_request(room, encode_bytes(img)))
        done = []
        for _ in range(60):
            done = receiver.pop_done(timeout_s=1.0)
            if done:
                break
        assert [d[0] for d in done] == [room]
        received = done[0][1].image_rows
        assert received.dtype == getattr(torch, wire) and received.shape == expected.shape
        assert received.shape[1] == 3 * service.layout.hidden_size  # main + 2 deepstack
        assert torch.equal(received.view(torch.uint8), expected.contiguous().view(torch.uint8))
        receiver.release(room)
    finally:
        receiver.close()
        service.close()


@pytest.mark.parametrize("cpu_kernels", ["torch", "native"])
@pytest.mark.parametrize("kernel", ["plain", "onednn"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_rows_match_transformers_bf16_tower(model_dirs, arch, kernel, cpu_kernels):
    """Our tower in bf16 against transformers' model loaded in bf16 (``from_pretrained(dtype=
    torch.bfloat16)``), same pixels, one forward of both images.

    Tolerance, against transformers in bf16, with the plain kernel and torch's ops
    (``cpu_kernels`` torch): none (bit-identical). With the onednn kernel (prepacked linears,
    bit-equal; the patch embedding as a linear layer, which sums in another order than the
    convolution), or the
    native RMSNorm (a row's sum of squares in another order; the native rotary embedding is
    bit-equal): ``ONEDNN_TOL`` of the rows' largest magnitude.
    With the plain kernel both run the same modules on
    the same bf16 weights, keep the rotary frequencies in fp32 (they are computed at build time,
    not loaded), and run the same CPU kernels on the same batch, so every rounding happens the
    same way. (Casting an fp32 model with ``.to(torch.bfloat16)`` instead also rounds the rotary
    frequencies and moves rows by one bf16 step, 2**-8 relative; a different batch or GPU
    kernels would too. Neither is the case here.)
    Tolerance, against transformers in fp32: 2% of the rows' largest magnitude. bf16 keeps 8
    significant bits, so each op rounds by up to 2**-9 relative and the error accumulates over
    the layers; measured 0.6% to 0.8% for these depth-2 towers (no bound for real depths).
    """
    from transformers import AutoModelForImageTextToText

    path = model_dirs[arch]
    config = EncoderConfig(
        device="cpu",
        dtype="bfloat16",
        cache_mb=0,
        linear_kernel=kernel,
        cpu_kernels=cpu_kernels,
        vision_attention="grouped",  # SDPA, as the reference attends
    )
    pipe = EncoderPipeline(path, config)
    ref = HFReference(path)
    bf16_model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.bfloat16)
    try:
        images = [noise_image(100, 80, 1), noise_image(60, 130, 2)]
        encoded = pipe.encode(user_turn(2), images)
        inputs = ref.build_chat_inputs(user_turn(2), images)
        grid = inputs.image_grid_thw
        with torch.no_grad():
            fp32 = ref.model.model.visual(inputs.pixel_values, grid_thw=grid)
            pixels = inputs.pixel_values.to(torch.bfloat16)
            bf16 = bf16_model.eval().model.visual(pixels, grid_thw=grid)

        def rows(out):
            parts = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
            return torch.cat(parts, -1)

        got, want, want32 = encoded.image_rows, rows(bf16), rows(fp32)
        assert pipe.tower.dtype == got.dtype == want.dtype == torch.bfloat16
        assert got.shape == want.shape
        scale = want32.abs().max().item()
        assert pipe.tower.cpu_kernels == cpu_kernels
        if pipe.tower.linear_kernel == "plain" and cpu_kernels == "torch":
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        else:
            assert (got.float() - want.float()).abs().max().item() <= ONEDNN_TOL * scale
        assert (got.float() - want32).abs().max().item() <= 0.02 * scale
    finally:
        pipe.close()
