"""Bad inputs: each is a clear ``InvalidInput`` and the pipeline keeps serving."""

from __future__ import annotations

import base64
import http.server
import io
import os
import threading

import pytest
from encoder_helpers import encode_bytes, noise_image, user_turn
from PIL import Image

from services.encoder.config import EncoderConfig
from services.encoder.decode import DecodeLimits, decode_image
from services.encoder.errors import InvalidInput
from services.encoder.intake import ImageIntake
from services.encoder.types import ChatMessage, ContentPart, ImageSource


def _png_bomb() -> bytes:
    return encode_bytes(Image.new("1", (12000, 12000)), "PNG")  # 144 Mpx, ~20 KB


def _corrupt_png() -> bytes:
    data = bytearray(encode_bytes(noise_image(64, 64)))
    data[60:80] = bytes(20)  # inside IDAT: the CRC no longer matches
    return bytes(data)


def _corrupt_jpeg() -> bytes:
    data = bytearray(encode_bytes(noise_image(64, 64), "JPEG"))
    data[2:120] = b"\xff" * 118  # marker soup instead of the JFIF header and tables
    return bytes(data)


BAD_DATA = {
    "truncated-png": (lambda: encode_bytes(noise_image(64, 64))[:300], "corrupt or truncated"),
    "truncated-jpeg": (
        lambda: encode_bytes(noise_image(64, 64), "JPEG")[:400],
        "corrupt or truncated",
    ),
    "corrupt-png": (_corrupt_png, "corrupt or truncated"),
    "corrupt-jpeg": (_corrupt_jpeg, "image"),
    "not-an-image": (lambda: b"%PDF-1.4 this is not an image" * 10, "not an image"),
    "bomb": (_png_bomb, "decompression bomb"),
    "1x1": (lambda: encode_bytes(noise_image(1, 1)), "at least 2 pixels"),
    "10000x20": (lambda: encode_bytes(noise_image(10000, 20)), "aspect ratio 500"),
    "empty": (lambda: b"", "empty image data"),
}


@pytest.mark.parametrize("name", sorted(BAD_DATA))
def test_bad_image_bytes(pipeline, name):
    make, needle = BAD_DATA[name]
    with pytest.raises(InvalidInput, match=needle) as info:
        pipeline.prepare(user_turn(1), [make()])
    assert info.value.item == 0
    # and the pipeline keeps serving
    assert pipeline.encode(user_turn(1), [noise_image(56, 56, 3)]).num_items == 1


def _messages_with(source: ImageSource) -> list[ChatMessage]:
    return [ChatMessage("user", (ContentPart(image=source), ContentPart(text="hi")))]


def test_bad_sources(pipeline, tmp_path):
    outside = tmp_path / "x.png"
    outside.write_bytes(encode_bytes(noise_image(56, 56)))
    link = pipeline.allowed_dir / "escape.png"
    if not link.exists():
        os.symlink(outside, link)
    cases = [
        (ImageSource("base64", "!!!not base64!!!"), "invalid base64"),
        # the standard library names what is wrong (the fast decoder only says it is)
        (ImageSource("base64", "iVBORw0KGgo"), r"invalid base64 image data \(Incorrect padding"),
        (ImageSource("base64", "data:image/png,abc"), "data URL must look like"),
        (ImageSource("path", str(outside)), "outside the allowed image directories"),
        (ImageSource("path", str(link)), "outside the allowed image directories"),
        (ImageSource("path", str(pipeline.allowed_dir / "../x.png")), "outside the allowed"),
        (ImageSource("path", str(pipeline.allowed_dir / "missing.png")), "cannot read"),
        (ImageSource("url", "http://127.0.0.1:1/a.png"), "URLs are disabled"),
    ]
    for source, needle in cases:
        with pytest.raises(InvalidInput, match=needle):
            pipeline.prepare(_messages_with(source))


def test_good_sources(pipeline):
    img = noise_image(56, 56, 4)
    png = encode_bytes(img)
    inside = pipeline.allowed_dir / "ok.png"
    inside.write_bytes(png)
    b64 = base64.b64encode(png).decode()
    sources = [
        ImageSource("data", png),
        ImageSource("base64", b64),
        ImageSource("base64", "data:image/png;base64," + b64),
        # MIME line breaks every 76 characters, as some clients send it
        ImageSource("base64", base64.encodebytes(png).decode()),
        ImageSource("path", str(inside)),
    ]
    keys = {pipeline.prepare(_messages_with(s)).images[0].key for s in sources}
    assert len(keys) == 1  # same pixels, same key, whatever the source


def test_limits(pipeline):
    with pytest.raises(InvalidInput, match="4 images; the limit is 3"):
        pipeline.prepare(user_turn(4), [noise_image(56, 56, i) for i in range(4)])
    with pytest.raises(InvalidInput, match=r"441 image in 1 image\), more than the limit of 400"):
        pipeline.prepare(user_turn(1), [noise_image(600, 600)])  # 441 image tokens
    with pytest.raises(InvalidInput, match="reserved token"):
        pipeline.prepare(user_turn(0, "look <|image_pad|> here"))
    with pytest.raises(InvalidInput, match="without an image part"):
        pipeline.prepare(user_turn(0), [noise_image(56, 56)])
    with pytest.raises(InvalidInput, match="unknown role"):
        pipeline.prepare([{"role": "robot", "content": "hi"}])


def test_mode_conversions():
    intake = ImageIntake(EncoderConfig())
    cmyk = Image.new("CMYK", (40, 30), (0, 255, 0, 0))  # magenta
    assert intake.load(encode_bytes(cmyk, "JPEG"), 0).mode == "RGB"
    palette = noise_image(40, 30).convert("P")
    assert intake.load(encode_bytes(palette, "PNG"), 0).mode == "RGB"
    rgba = Image.new("RGBA", (40, 30), (255, 0, 0, 0))  # fully transparent red
    assert intake.load(encode_bytes(rgba), 0).getpixel((0, 0)) == (255, 255, 255)
    la = Image.new("LA", (40, 30), (0, 255))
    assert intake.load(encode_bytes(la), 0).getpixel((0, 0)) == (0, 0, 0)


def test_animated_gif_uses_first_frame():
    frames = [Image.new("RGB", (40, 30), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    img = decode_image(buf.getvalue(), DecodeLimits())
    assert img.mode == "RGB" and img.getpixel((5, 5)) == (255, 0, 0)


def test_exif_orientation_is_applied():
    img = noise_image(60, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    decoded = decode_image(encode_bytes(img, "JPEG", exif=exif.tobytes()), DecodeLimits())
    assert decoded.size == (30, 60)


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_urls(tmp_path):
    _Handler.body = encode_bytes(noise_image(56, 56, 7))
    server = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/img.png"
    try:
        public_only = ImageIntake(EncoderConfig(allow_urls=True))
        with pytest.raises(InvalidInput, match="non-public address"):
            public_only.load(ImageSource("url", url), 0)
        with pytest.raises(InvalidInput, match="http or https only"):
            public_only.load(ImageSource("url", "file:///etc/passwd"), 0)
        private_ok = ImageIntake(EncoderConfig(allow_urls=True, allow_private_urls=True))
        assert private_ok.load(ImageSource("url", url), 0).size == (56, 56)
        small = ImageIntake(
            EncoderConfig(allow_urls=True, allow_private_urls=True, max_image_bytes=100)
        )
        with pytest.raises(InvalidInput, match="limit is 100"):
            small.load(ImageSource("url", url), 0)
    finally:
        server.shutdown()
