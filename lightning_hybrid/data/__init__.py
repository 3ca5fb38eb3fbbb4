"""Data: packed token datasets and the data modules of the recipes."""

from lightning_hybrid.data.byte_text import ByteTextDataModule, PackedSequences, stdlib_text
from lightning_hybrid.data.packed import PackedTokenDataModule, PackedTokenDataset

__all__ = ["ByteTextDataModule", "PackedSequences", "PackedTokenDataModule", "PackedTokenDataset", "stdlib_text"]
