"""Reading new labelled data: a CIFAR batch file or a folder of images in class-named subfolders.

    batch file   the pickle layout of `data_batch_N`, read with the archive's restricted unpickler
    folder       PATH/<class name>/<file>, PNG or JPEG, 32x32 RGB; `cat/001.png` is a cat

Nothing is trusted: a file that cannot be used is listed with why and left out; the validation gate
decides whether that is acceptable (docs/DATA.md, "Reading additions"). A source with no usable image
at all is refused here (`NoUsableImagesError`), naming every file's reason.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from cifar.data.manifest import IMAGE_SHAPE
from cifar.text import printable

MAX_BATCH_FILE_BYTES = 1 << 30  # An official batch is 31 MB; a 1 GiB pickle (330,000 images) is the ceiling.
IMAGE_FORMATS = {"PNG", "JPEG"}
MAX_DECODED_PIXELS = 7680 * 4320  # An 8K frame (~100 MB as RGB): the largest image a declared resize decodes.
# Declared resizes an addition may opt into (PIL's filters); the method is recorded with the addition.
RESIZE_METHODS = ("bilinear", "bicubic", "lanczos", "box", "nearest")
DIGEST_PREFIX = b"cifar-addition-v1\n"  # Versions the digest's definition, not the data.
NAMED_PROBLEMS = 5  # Files named in the one line of a NoUsableImagesError; the rest are counted.


class FileProblem(BaseModel):
    """One file of an addition that was left out, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str  # Relative to the addition (a folder), or `<batch file>#<row>`.
    problem: str  # The kind: undecodable, truncated, size, mode, unknown_class, not_in_class_folder, link, format.
    detail: str


class NoUsableImagesError(ValueError):
    """Not one image of a source could be used: one line naming the source and why its files were left out.

    An ordinary outcome of every reader (an empty folder, a misspelt class folder, a folder of text
    files, an empty batch file or array), refused where it is read, before anything is stored or scored.
    """

    def __init__(self, source: str | Path, problems: Sequence[FileProblem], empty: str) -> None:
        self.problems = list(problems)
        if self.problems:
            shown = "; ".join(
                f"{printable(item.file)} ({item.problem}: {printable(item.detail)})"
                for item in problems[:NAMED_PROBLEMS]
            )
            more = f"; and {len(problems) - NAMED_PROBLEMS} more" if len(problems) > NAMED_PROBLEMS else ""
            reason = f"{len(problems)} file{'s' if len(problems) > 1 else ''} left out: {shown}{more}"
        else:
            reason = empty  # Nothing was left out: there was nothing (`empty` says so in the source's terms).
        super().__init__(f"no usable image in {source}: {reason}")


@dataclass(frozen=True)
class Addition:
    """The usable content of a labelled source, in canonical order, and what was left out.

    Canonical order: a folder's files sorted by path, a batch file's rows as they are; so the same
    content is the same addition (the same `digest`) however often and however packaged it is offered.
    """

    images: np.ndarray  # (N, 32, 32, 3) uint8
    labels: np.ndarray  # (N,) int64, class ids of the base archive's class names
    names: list[str]  # Per image: its file (folder) or `<file>#<row>` (batch file).
    kind: str  # "folder" or "batch_file"
    source: str  # The path it was read from.
    resize: str | None = None  # The declared resize method, when images of another size were resized.
    problems: list[FileProblem] = field(default_factory=list)

    @property
    def digest(self) -> str:
        """SHA-256 of the labels and pixels in canonical order: the addition's identity in the data store."""
        digest = hashlib.sha256(DIGEST_PREFIX)
        digest.update(np.ascontiguousarray(self.labels, dtype="<i8").tobytes())
        digest.update(np.ascontiguousarray(self.images, dtype=np.uint8).tobytes())
        return digest.hexdigest()


def read_addition(path: str | Path, class_names: list[str], *, resize: str | None = None) -> Addition:
    """Reads a batch file or an image folder (decided by what `path` is); raises ValueError if it is neither,
    and NoUsableImagesError (a ValueError) if not one of its images can be used."""
    path = Path(path).expanduser()
    if resize is not None and resize not in RESIZE_METHODS:
        raise ValueError(f"resize must be one of {', '.join(RESIZE_METHODS)}, got {resize!r}")
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link: give the file or folder itself")
    if path.is_dir():
        addition = read_image_folder(path, class_names, resize=resize)
    elif path.is_file():
        if resize is not None:
            raise ValueError("resize applies to image folders; a batch file's rows are 32x32 by definition")
        addition = read_batch_file(path)
    else:
        raise ValueError(f"no file or folder at {path}")
    if not len(addition.labels):
        empty = "the folder holds no files" if addition.kind == "folder" else "the batch file holds no images"
        raise NoUsableImagesError(path, addition.problems, empty)
    return addition


def read_batch_file(path: str | Path) -> Addition:
    """A CIFAR batch file (pickle layout of data_batch_N), through the restricted unpickler."""
    from cifar.data.archive import rows_to_images

    path = Path(path)
    rows, labels = read_batch_rows(path)
    return Addition(
        images=rows_to_images([rows]),
        labels=labels.astype(np.int64),
        names=[f"{path.name}#{row}" for row in range(len(labels))],
        kind="batch_file",
        source=str(path.resolve()),
    )


def read_batch_rows(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The official rows (N, 3072) and labels (N,) of a CIFAR batch file, through the restricted unpickler.

    Refuses a file over MAX_BATCH_FILE_BYTES before reading it. Shared with batch prediction.
    """
    from cifar.data.archive import parse_python_batch

    path = Path(path)
    size = path.stat().st_size
    if size > MAX_BATCH_FILE_BYTES:
        raise ValueError(f"{path} is {size:,} bytes, over the {MAX_BATCH_FILE_BYTES:,} byte limit of a batch file")
    return parse_python_batch(path.read_bytes(), path.name)  # InvalidDatasetError / UnsafePickleError name it.


def read_image_folder(path: str | Path, class_names: list[str], *, resize: str | None = None) -> Addition:
    """PATH/<class>/<file> images; every file that cannot be used is listed in `problems`."""
    root = Path(path)
    class_ids = {name: index for index, name in enumerate(class_names)}
    images: list[np.ndarray] = []
    labels: list[int] = []
    names: list[str] = []
    problems: list[FileProblem] = []
    for relative, entry in walk_files(root):
        parts = Path(relative).parts
        if entry is None:  # A link, or something that is not a regular file or directory.
            problems.append(FileProblem(file=relative, problem="link", detail="links and special files are not read"))
            continue
        if len(parts) != 2:
            detail = "images must be in PATH/<class name>/<file>"
            problems.append(FileProblem(file=relative, problem="not_in_class_folder", detail=detail))
            continue
        if parts[0] not in class_ids:
            detail = f"folder {parts[0]!r} is not a class name ({', '.join(class_names)})"
            problems.append(FileProblem(file=relative, problem="unknown_class", detail=detail))
            continue
        image, problem = decode_image(root / relative, resize)
        if problem is not None:
            problems.append(FileProblem(file=relative, problem=problem[0], detail=problem[1]))
            continue
        images.append(image)
        labels.append(class_ids[parts[0]])
        names.append(relative)
    return Addition(
        images=np.stack(images) if images else np.zeros((0, *IMAGE_SHAPE), np.uint8),
        labels=np.asarray(labels, np.int64),
        names=names,
        kind="folder",
        source=str(root.resolve()),
        resize=resize,
        problems=problems,
    )


def walk_files(root: Path) -> list[tuple[str, os.DirEntry | None]]:
    """(relative path, DirEntry or None for links and special files) of every file under `root`, sorted by path.

    Links are never followed (a link to a directory is listed, not entered). Shared with batch
    prediction (cifar.predict), which reads image folders the same way.
    """
    pending = [""]
    found = []
    while pending:
        relative_dir = pending.pop()
        with os.scandir(root / relative_dir) as entries:
            for entry in entries:
                relative = f"{relative_dir}/{entry.name}" if relative_dir else entry.name
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    pending.append(relative)
                elif stat.S_ISREG(mode):
                    found.append((relative, entry))
                else:
                    found.append((relative, None))
    return sorted(found, key=lambda item: item[0])


def decode_image(
    source: Path | bytes, resize: str | None, *, max_pixels: int = MAX_DECODED_PIXELS
) -> tuple[np.ndarray | None, tuple[str, str] | None]:
    """(HWC uint8 image (32, 32, 3), None) or (None, (problem kind, detail)) for one PNG or JPEG file or its bytes.

    The kinds: format, undecodable, truncated, mode, size (another size without a declared `resize`, or more
    than `max_pixels` with one). The size is judged from the header, before anything is decoded: a few
    hundred bytes can declare gigapixels. The one home of decoding and resizing: ingestion, batch prediction
    (cifar.predict) and the endpoint (cifar.endpoint, photos sent as bytes) read an image the same way.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL's remarks on a damaged file ("Corrupt EXIF data") are not for people.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:  # The header only.
                if image.format not in IMAGE_FORMATS:
                    return None, ("format", f"{image.format} image; only PNG and JPEG are read")
                width, height = image.size
                if (width, height) != IMAGE_SHAPE[:2] and resize is None:
                    return None, ("size", f"{width}x{height} pixels, expected 32x32 (or opt into a declared resize)")
                if width * height > max_pixels:
                    return None, ("size", f"{width}x{height} pixels, over the {max_pixels:,} pixels of "
                                          "the largest image a resize decodes")  # fmt: skip
                image.load()  # Decodes every byte: a truncated file fails here.
                image = _as_rgb(image)
                if image is None:
                    return None, ("mode", "not an RGB image (grey, CMYK, or transparent pixels)")
                if image.size != IMAGE_SHAPE[:2]:
                    image = image.resize(IMAGE_SHAPE[:2], getattr(Image.Resampling, resize.upper()))
                return np.asarray(image, np.uint8).copy(), None
    except UnidentifiedImageError:
        return None, ("undecodable", "not an image PIL can read")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:  # PIL's own header check.
        return None, ("size", str(error))
    except (OSError, SyntaxError, ValueError) as error:
        kind = "truncated" if "truncated" in str(error).lower() else "undecodable"
        return None, (kind, f"{type(error).__name__}: {error}")


def _as_rgb(image):
    """The image as RGB when that loses nothing (RGB, a palette, or fully opaque RGBA), else None."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" not in image.info:
        return image.convert("RGB")
    if image.mode in ("RGBA", "P"):
        rgba = image.convert("RGBA")
        if rgba.getextrema()[3][0] == 255:  # Every pixel fully opaque.
            return rgba.convert("RGB")
    return None
