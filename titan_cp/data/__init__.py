"""Data: tokenizers, document sources (synthetic, text, chat trajectories, mixtures), packing with
document boundaries and loss masks, and DP-aware loading."""

from titan_cp.data.chat import ChatJsonl, render_chat
from titan_cp.data.datasets import HFDiskDataset, SyntheticRecall, TextFiles, build_dataset
from titan_cp.data.document import Document, DocumentSource
from titan_cp.data.loader import Batch, PackedDataLoader, Step, build_dataloader
from titan_cp.data.mixture import Mixture
from titan_cp.data.packing import IGNORE_INDEX, BestFitPacker, PackedRow, Packer, RowSummary, make_packer
from titan_cp.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "BestFitPacker",
    "ByteTokenizer",
    "ChatJsonl",
    "Document",
    "DocumentSource",
    "HFDiskDataset",
    "HFTokenizer",
    "Mixture",
    "PackedDataLoader",
    "PackedRow",
    "Packer",
    "RowSummary",
    "Step",
    "SyntheticRecall",
    "TextFiles",
    "Tokenizer",
    "build_dataloader",
    "build_dataset",
    "build_tokenizer",
    "make_packer",
    "render_chat",
]
