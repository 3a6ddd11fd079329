"""A synthetic Fashion-MNIST in the Debian package's IDX files, for the grid tests (no tests here)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX: magic (0, 0, dtype 0x08 = ubyte, ndim), one big-endian uint32 per dimension, then the bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def synthetic_fmnist(root: Path, n_train: int = 1200, n_test: int = 300, seed: int = 0) -> Path:
    """Ten classes, each a bright 7 × 7 block at its own place plus noise: learnable in a few steps."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("t10k", n_test)):
        y = rng.integers(0, 10, size=n).astype(np.uint8)
        x = rng.integers(0, 60, size=(n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(y):
            r, col = divmod(int(c), 4)
            x[i, 7 * r : 7 * r + 7, 7 * col : 7 * col + 7] = 255
        write_idx(root / f"{split}-images-idx3-ubyte.gz", x)
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", y)
    return root
