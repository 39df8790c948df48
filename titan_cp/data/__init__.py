"""Data: tokenizers, document sources, packing with document boundaries, and DP-aware loading."""

from titan_cp.data.datasets import (
    Document,
    DocumentSource,
    HFDiskDataset,
    SyntheticRecall,
    TextFiles,
    build_dataset,
)
from titan_cp.data.loader import Batch, PackedDataLoader, Step, build_dataloader
from titan_cp.data.packing import IGNORE_INDEX, PackedRow, Packer
from titan_cp.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "ByteTokenizer",
    "Document",
    "DocumentSource",
    "HFDiskDataset",
    "HFTokenizer",
    "PackedDataLoader",
    "PackedRow",
    "Packer",
    "Step",
    "SyntheticRecall",
    "TextFiles",
    "Tokenizer",
    "build_dataloader",
    "build_dataset",
    "build_tokenizer",
]
