"""Data and model loading for dp-bench: packaged corpora/weights that install offline, hub fallback.

Needs the ``datasets`` package. See ``docs/demo.md`` for the offline packages.
"""

from .images import FASHION_MNIST_APT, FASHION_MNIST_CLASSES, load_fashion_mnist, read_idx
from .models import (
    MINILM_HUB_ID,
    MINILM_PIP,
    load_minilm,
    minilm_path,
    synthetic_text_task,
    tiny_bert,
    tiny_bert_config,
)
from .text import (
    BBC_HUB_ID,
    BBC_PIP,
    RT_HUB_ID,
    RT_PIP,
    DataUnavailableError,
    dedupe,
    label_counts,
    load_bbc_news,
    load_rotten_tomatoes,
    normalize_text,
    package_dir,
    read_bbc_folder,
    read_rotten_tomatoes_csv,
    stratified_split,
    tokenize,
)

__all__ = [
    "FASHION_MNIST_APT",
    "FASHION_MNIST_CLASSES",
    "load_fashion_mnist",
    "read_idx",
    "BBC_HUB_ID",
    "BBC_PIP",
    "MINILM_HUB_ID",
    "MINILM_PIP",
    "RT_HUB_ID",
    "RT_PIP",
    "DataUnavailableError",
    "dedupe",
    "label_counts",
    "load_bbc_news",
    "load_minilm",
    "load_rotten_tomatoes",
    "minilm_path",
    "normalize_text",
    "package_dir",
    "read_bbc_folder",
    "read_rotten_tomatoes_csv",
    "stratified_split",
    "synthetic_text_task",
    "tiny_bert",
    "tiny_bert_config",
    "tokenize",
]
