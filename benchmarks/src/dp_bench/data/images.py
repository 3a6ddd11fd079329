"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (60,000 train / 10,000 test, 28 × 28, 10 classes).

``apt-get install dataset-fashion-mnist`` puts the four IDX files (gzip) in ``/usr/share/datasets/fashion-mnist``;
:func:`load_fashion_mnist` parses them (the IDX format: a big-endian header — magic number with the data type
and the number of dimensions, then one 4-byte size per dimension — followed by the raw bytes).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch

from .text import DataUnavailableError

__all__ = ["FASHION_MNIST_APT", "FASHION_MNIST_CLASSES", "load_fashion_mnist", "read_idx"]

FASHION_MNIST_APT = "apt-get install dataset-fashion-mnist"
DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (optionally gzip-compressed) as a numpy array of unsigned bytes."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (header {zero:#x} {dtype:#x})")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {body.size} bytes for shape {shape}")
    return body.reshape(shape)


def load_fashion_mnist(root: str | Path | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train": (images, labels), "test": (images, labels)}``: images float32 ``[n, 1, 28, 28]`` scaled to
    [0, 1], labels int64. ``root`` (default ``$FASHION_MNIST_ROOT`` or the Debian package's folder) holds the
    four ``*-ubyte.gz`` files; :class:`~dp_bench.data.DataUnavailableError` names the package when missing."""
    base = Path(root or os.environ.get("FASHION_MNIST_ROOT", DEFAULT_ROOT))
    missing = [name for pair in FILES.values() for name in pair if not (base / name).is_file()]
    if missing:
        raise DataUnavailableError(
            f"Fashion-MNIST is not installed (missing {missing} in {base}). Install the Debian package as root: "
            f"`apt-get update && {FASHION_MNIST_APT}`, or set FASHION_MNIST_ROOT to a folder with the IDX files."
        )
    out = {}
    for split, (images, labels) in FILES.items():
        x = torch.from_numpy(read_idx(base / images).astype(np.float32) / 255.0).unsqueeze(1)
        y = torch.from_numpy(read_idx(base / labels).astype(np.int64))
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{split}: {x.shape[0]} images but {y.shape[0]} labels")
        out[split] = (x, y)
    return out
