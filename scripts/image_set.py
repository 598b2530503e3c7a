#!/usr/bin/env python
"""A benchmark image set, built here (nothing is downloaded), deterministic (seeded per image).

Three kinds, each a folder of `count` files:

* web    -- 500x400 JPEGs (0.2 MP), quality 85: what a web page or a chat upload holds;
* camera -- 4000x3000 JPEGs (12 MP), quality 92, with a camera's EXIF tags: a phone's photo,
            3-6 MB like a real one;
* png    -- 500x400 RGBA PNGs with soft transparent edges: cut-outs, logos, stickers.

Content: crops of the photographs that ship inside installed packages (scikit-learn's
`datasets/images`, matplotlib's `mpl-data/sample_data`, scikit-image's `data`, whichever are
installed), and generated scenes (gradients with drawn shapes, fractal noise textures, posters of
shapes and text) drawn at several sizes, then scaled and cropped to the target size. Grain (per-pixel
and smooth noise) is added last so the files compress as photographs do: a smooth synthetic image
would make a 12 MP JPEG of a few hundred KB, and decoding it would cost less than a real photo's.

    python scripts/image_set.py                        # all kinds into build/bench-images
    python scripts/image_set.py --kinds camera --count 24 --folder /tmp/images
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

KINDS = {
    # kind: (width, height, file suffix)
    "web": (500, 400, ".jpg"),
    "camera": (4000, 3000, ".jpg"),
    "png": (500, 400, ".png"),
}
JPEG_QUALITY = {"web": 85, "camera": 92}
# Per-pixel grain (standard deviation in 0-255 levels): a camera's sensor noise at 12 MP is what
# makes its JPEG 3-6 MB; a web image is downscaled, which averages most of it away.
GRAIN = {"web": 3.5, "camera": 5.0, "png": 1.5}
# The sizes the generated scenes are drawn at before they are scaled to the target: upscaled
# content is smooth (as a photo's large areas are), downscaled content is detailed.
SOURCE_SIZES = ((320, 240), (640, 480), (1024, 768), (1600, 1200), (800, 1000))
DEFAULT_COUNTS = {"web": 200, "camera": 24, "png": 200}
# Where installed packages keep sample photographs (package, folder inside it).
PHOTO_FOLDERS = (("sklearn", "datasets/images"), ("matplotlib", "mpl-data/sample_data"), ("skimage", "data"))
PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png")
SET_VERSION = 1  # bumped when the generated content changes, so a stale set is rebuilt


# ---- sources ---------------------------------------------------------------------------------------

def photo_sources() -> tuple[list[Path], list[str]]:
    """(sample photographs of the installed packages, the packages looked for but not installed).
    The package is located without importing it (matplotlib's import alone costs a second)."""
    photos, missing = [], []
    for package, folder in PHOTO_FOLDERS:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            missing.append(package)
            continue
        where = Path(next(iter(spec.submodule_search_locations))) / folder
        photos += sorted(p for p in where.glob("*") if p.suffix.lower() in PHOTO_SUFFIXES
                         and p.stat().st_size > 20_000)  # photographs, not icons
    return photos, missing


@cache
def load_photo(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


# ---- generated scenes --------------------------------------------------------------------------------

def smooth_noise(rng: np.random.Generator, size: tuple[int, int], cell: int) -> np.ndarray:
    """Noise in [-1, 1] that varies over about `cell` pixels: a coarse random grid, upscaled bicubic."""
    width, height = size
    coarse = rng.uniform(-1, 1, (height // cell + 2, width // cell + 2)).astype(np.float32)
    return np.asarray(Image.fromarray(coarse, mode="F").resize(size, Image.BICUBIC))


def fractal_noise(rng: np.random.Generator, size: tuple[int, int], octaves: int = 5) -> np.ndarray:
    """Clouds, terrain, foliage: octaves of smooth noise, each half the cell and half the weight."""
    width, height = size
    out = np.zeros((height, width), np.float32)
    cell, weight = max(width, height) // 3, 1.0
    for _ in range(octaves):
        out += weight * smooth_noise(rng, size, max(2, cell))
        cell, weight = cell // 2, weight / 2
    return out / 2.0


def random_color(rng: np.random.Generator, low: int = 0, high: int = 256) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(low, high, 3))


def vertical_gradient(size: tuple[int, int], top, bottom) -> np.ndarray:
    width, height = size
    t = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    column = (1 - t) * np.array(top, np.float32) + t * np.array(bottom, np.float32)
    return np.broadcast_to(column, (height, width, 3)).copy()


def gradient_scene(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A landscape: sky gradient, a sun, hills and blocks of buildings, softened like a lens would."""
    width, height = size
    horizon = int(height * rng.uniform(0.4, 0.7))
    sky = vertical_gradient((width, horizon), random_color(rng, 60, 200), random_color(rng, 150, 256))
    ground = vertical_gradient((width, height - horizon), random_color(rng, 20, 140), random_color(rng, 0, 90))
    image = Image.fromarray(np.concatenate([sky, ground]).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    r = int(min(size) * rng.uniform(0.04, 0.12))
    cx, cy = int(rng.uniform(0, width)), int(rng.uniform(0, horizon))
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=random_color(rng, 200, 256))
    for _ in range(int(rng.integers(2, 6))):  # hills: polygons along the horizon
        xs = np.sort(rng.uniform(-0.2, 1.2, 6)) * width
        ys = horizon - rng.uniform(0, 0.3, 6) * height
        draw.polygon([(xs[0], horizon + 2)] + list(zip(xs, ys, strict=True)) + [(xs[-1], horizon + 2)],
                     fill=random_color(rng, 20, 160))
    for _ in range(int(rng.integers(0, 12))):  # buildings: rectangles standing on the horizon
        x0 = rng.uniform(0, width)
        w, h = rng.uniform(0.02, 0.1) * width, rng.uniform(0.05, 0.35) * height
        draw.rectangle((x0, horizon - h, x0 + w, horizon + 4), fill=random_color(rng, 40, 220))
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 2.0)))


def noise_texture(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """Fractal noise through a random three-color palette: clouds, rock, foliage, water."""
    field = np.clip(fractal_noise(rng, size) * 0.5 + 0.5, 0, 1)[..., None]
    low, mid, high = (np.array(random_color(rng), np.float32) for _ in range(3))
    pixels = np.where(field < 0.5, low + (mid - low) * field * 2, mid + (high - mid) * (field - 0.5) * 2)
    return Image.fromarray(pixels.astype(np.uint8))


def poster(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """Flat shapes, lines and text on a gradient: a sign, a slide, a screenshot, a product label."""
    width, height = size
    image = Image.fromarray(vertical_gradient(size, random_color(rng), random_color(rng)).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 12))):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        x1, y1 = x0 + rng.uniform(0.05, 0.5) * width, y0 + rng.uniform(0.05, 0.5) * height
        shape = rng.integers(3)
        if shape == 0:
            draw.rectangle((x0, y0, x1, y1), fill=random_color(rng))
        elif shape == 1:
            draw.ellipse((x0, y0, x1, y1), fill=random_color(rng), outline=random_color(rng), width=3)
        else:
            draw.line((x0, y0, x1, y1), fill=random_color(rng), width=int(rng.integers(1, 8)))
    for _ in range(int(rng.integers(1, 5))):
        font = ImageFont.load_default(size=int(height * rng.uniform(0.04, 0.12)))
        words = " ".join(rng.choice(WORDS, int(rng.integers(1, 5))))
        draw.text((rng.uniform(0, 0.6) * width, rng.uniform(0, 0.9) * height), words, fill=random_color(rng), font=font)
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))


WORDS = ("OPEN", "Sale", "coffee", "Station", "exit", "Menu", "2024", "hello", "river", "North", "Platform 3",
         "fresh bread", "No parking", "welcome", "Total", "Q3 results")


def photo_crop(rng: np.random.Generator, photos: list[Path]) -> Image.Image:
    """A random crop (a half to the whole of the photo), maybe mirrored, with its colors shifted."""
    photo = load_photo(photos[int(rng.integers(len(photos)))])
    fraction = rng.uniform(0.5, 1.0)
    w, h = int(photo.width * fraction), int(photo.height * fraction)
    x, y = int(rng.integers(photo.width - w + 1)), int(rng.integers(photo.height - h + 1))
    crop = photo.crop((x, y, x + w, y + h))
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    gain = rng.uniform(0.8, 1.2, 3).astype(np.float32)
    return Image.fromarray(np.clip(np.asarray(crop, np.float32) * gain, 0, 255).astype(np.uint8))


def scene(rng: np.random.Generator, photos: list[Path]) -> Image.Image:
    """One image's content, drawn at one of the source sizes (a photo crop at the photo's own size)."""
    makers = [gradient_scene, noise_texture, poster]
    choice = int(rng.integers(len(makers) + (2 if photos else 0)))  # photos: 2 in 5 when there are any
    if choice >= len(makers):
        return photo_crop(rng, photos)
    return makers[choice](rng, SOURCE_SIZES[int(rng.integers(len(SOURCE_SIZES)))])


# ---- to the target size, grain, files ------------------------------------------------------------------

def cover(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Scaled (bicubic) to cover `size`, then center-cropped to it: the whole target is content."""
    width, height = size
    scale = max(width / image.width, height / image.height)
    scaled = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                          Image.BICUBIC)
    x, y = (scaled.width - width) // 2, (scaled.height - height) // 2
    return scaled.crop((x, y, x + width, y + height))


def add_grain(rng: np.random.Generator, image: Image.Image, sigma: float) -> Image.Image:
    """Sensor-like noise: per-pixel grain, plus a smooth light falloff so flat areas are not flat.
    The grain is one luminance field and a weaker one per channel, as a camera's is."""
    width, height = image.size
    pixels = np.asarray(image, np.float32)
    luminance = rng.standard_normal((height, width, 1), dtype=np.float32) * sigma
    chroma = rng.standard_normal((height, width, 3), dtype=np.float32) * (sigma / 3)
    shading = smooth_noise(rng, (width, height), max(8, min(width, height) // 4))[..., None] * 12
    return Image.fromarray(np.clip(pixels + luminance + chroma + shading, 0, 255).astype(np.uint8))


def soft_alpha(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """A cut-out's mask: a few overlapping blobs, opaque inside, fading out over a feathered edge."""
    width, height = size
    mask = Image.new("L", size, 0)
    draw = ImageDraw.Draw(mask)
    for _ in range(int(rng.integers(1, 4))):
        cx, cy = rng.uniform(0.3, 0.7) * width, rng.uniform(0.3, 0.7) * height
        rx, ry = rng.uniform(0.15, 0.4) * width, rng.uniform(0.15, 0.4) * height
        draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=255)
    return mask.filter(ImageFilter.GaussianBlur(rng.uniform(2, 12)))


def camera_exif() -> Image.Exif:
    """What a phone writes: make, model, upright orientation (so nothing is rotated on opening)."""
    exif = Image.Exif()
    exif[0x010F] = "Example"  # Make
    exif[0x0110] = "Phone 12MP"  # Model
    exif[0x0112] = 1  # Orientation: upright
    return exif


def make_image(kind: str, index: int, photos: list[Path]) -> Image.Image:
    """Image `index` of `kind`, the same on every run: its own seed (kind, index)."""
    width, height, _ = KINDS[kind]
    rng = np.random.default_rng([list(KINDS).index(kind), index])
    image = add_grain(rng, cover(scene(rng, photos), (width, height)), GRAIN[kind])
    if kind == "png":
        image.putalpha(soft_alpha(rng, (width, height)))
    return image


def save_image(image: Image.Image, kind: str, path: Path) -> None:
    if kind == "png":
        image.save(path, format="PNG")
    else:
        extra = {"exif": camera_exif()} if kind == "camera" else {}
        image.save(path, format="JPEG", quality=JPEG_QUALITY[kind], **extra)


def build_image_set(folder: str | Path, kind: str, count: int) -> list[str]:
    """The paths of `count` images of `kind` in `folder`/`kind`, built there unless a set of the same
    version built before holds them already (a larger set serves a smaller count: its first images)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    target = Path(folder) / kind
    manifest = target / "manifest.json"
    names = [f"{index:04d}{KINDS[kind][2]}" for index in range(count)]
    built = json.loads(manifest.read_text()) if manifest.exists() else {}
    if built.get("version") != SET_VERSION or built.get("count", 0) < count:
        target.mkdir(parents=True, exist_ok=True)
        photos, _ = photo_sources()
        for index, name in enumerate(names):
            save_image(make_image(kind, index, photos), kind, target / name)
        manifest.write_text(json.dumps({"version": SET_VERSION, "count": count, "photos": [str(p) for p in photos]}))
    return [str(target / name) for name in names]


def describe_set(paths: list[str]) -> str:
    sizes = [Path(p).stat().st_size for p in paths]
    with Image.open(paths[0]) as first:
        shape = f"{first.width}x{first.height} {first.mode}"
    return (f"{len(paths)} files, {shape}, {np.mean(sizes) / 1e3:,.0f} kB mean "
            f"({min(sizes) / 1e3:,.0f}-{max(sizes) / 1e3:,.0f} kB)")


def default_folder() -> Path:
    """build/bench-images in the repository: build/ is ignored by git."""
    return Path(__file__).resolve().parent.parent / "build" / "bench-images"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=str(default_folder()))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--count", type=int, default=None, help="images per kind (default: web 200, camera 24, png 200)")
    args = parser.parse_args(argv)
    photos, missing = photo_sources()
    print(f"photographs from installed packages: {', '.join(str(p) for p in photos) or 'none'}")
    if missing:
        print(f"not installed, so none of their sample photographs: {', '.join(missing)}")
    for kind in args.kinds:
        paths = build_image_set(args.folder, kind, args.count or DEFAULT_COUNTS[kind])
        print(f"{kind}: {describe_set(paths)} in {Path(paths[0]).parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
