"""Test images, built here (never downloaded): photo-like content (gradients, smooth noise, drawn
shapes and text) saved in the formats and modes people's folders hold -- JPEG (with an EXIF
rotation, and CMYK), PNG (RGBA, palette with transparency, 16-bit grey, grey+alpha, 1-bit),
GIF, BMP, TIFF, WebP -- plus the broken files a corpus also holds."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

# The test files that a torchvision image processor (what transformers, and so ST, picks where
# torchvision is installed) does not decode to 8-bit RGB, with the pipeline's refusal of each: its
# decoder reads no BMP or TIFF (ST fails on them too), and keeps a 16-bit PNG at 16 bits (the
# pipeline's wire carries 8-bit pixels).
TORCHVISION_REFUSES = {"picture.bmp": "cannot be decoded", "picture.tiff": "cannot be decoded",
                       "grey16.png": "decodes to uint16 pixels"}


def refused_here(backend: str) -> dict[str, str]:
    """{file name: the pipeline's refusal} for the image processor backend of this environment."""
    return TORCHVISION_REFUSES if backend == "torchvision" else {}


def photo(width: int, height: int, seed: int = 0):
    """An RGB image with a photo's statistics: smooth gradients, blurred noise, shapes and text."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    noise = rng.normal(0, 40, (height // 8 + 1, width // 8 + 1, 3)).astype(np.float32)
    noise = np.kron(noise, np.ones((8, 8, 1), np.float32))[:height, :width]
    image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(2))
    draw = ImageDraw.Draw(image)
    for k in range(6 if min(width, height) > 20 else 0):
        x0, y0 = int(rng.integers(0, width - 10)), int(rng.integers(0, height - 10))
        box = (x0, y0, x0 + int(rng.integers(5, width // 2)), y0 + int(rng.integers(5, height // 2)))
        color = tuple(int(c) for c in rng.integers(0, 255, 3))
        (draw.ellipse if k % 2 else draw.rectangle)(box, fill=color)
    draw.text((5, 5), f"sample {seed}", fill=(255, 255, 255))
    return image


def build_image_files(folder: Path) -> dict[str, Path]:
    """Every test image as a file, by name."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}

    def save(name: str, image, **kwargs) -> None:
        files[name] = folder / name
        image.save(files[name], **kwargs)

    rgb = photo(320, 240, seed=1)
    save("photo.jpg", rgb, quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees on display
    save("rotated.jpg", photo(300, 200, seed=2), quality=90, exif=exif)
    save("cmyk.jpg", photo(250, 260, seed=3).convert("CMYK"), quality=90)
    rgba = photo(200, 150, seed=4).convert("RGBA")
    alpha = np.zeros((150, 200), np.uint8)
    alpha[:, 100:] = 255
    alpha[40:110, :] = 128
    rgba.putalpha(Image.fromarray(alpha))
    save("alpha.png", rgba)
    palette = photo(180, 180, seed=5).quantize(colors=64)
    save("palette.png", palette, transparency=3)
    grey16 = Image.fromarray((np.asarray(photo(160, 120, seed=6).convert("L"), np.uint16) * 257).astype(np.uint16))
    save("grey16.png", grey16)
    save("grey_alpha.png", photo(140, 220, seed=7).convert("LA"))
    save("bilevel.png", photo(128, 96, seed=8).convert("1"))
    save("anim.gif", photo(120, 90, seed=9).convert("P"))
    save("picture.bmp", photo(96, 130, seed=10))
    save("picture.tiff", photo(230, 170, seed=11))
    save("picture.webp", photo(210, 140, seed=12), quality=80)
    save("wide.png", photo(900, 40, seed=13))
    save("tiny.png", photo(64, 48, seed=14).resize((3, 2)))
    return files


def build_broken_files(folder: Path, source: Path) -> dict[str, Path]:
    """Files that are not decodable images: truncated, not an image, empty, and a PNG whose header
    claims 30000 x 30000 pixels (a decompression bomb: refused before decoding)."""
    folder.mkdir(parents=True, exist_ok=True)
    truncated = folder / "truncated.jpg"
    truncated.write_bytes(source.read_bytes()[:1500])
    not_image = folder / "notes.png"
    not_image.write_text("this is not an image")
    empty = folder / "empty.jpg"
    empty.write_bytes(b"")
    return {"truncated": truncated, "not an image": not_image, "empty": empty, "bomb": _png_bomb(folder / "bomb.png")}


def _png_bomb(path: Path) -> Path:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    side = 30000
    header = side.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])  # 8-bit RGB
    data = zlib.compress(b"\x00" * 1024)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path
