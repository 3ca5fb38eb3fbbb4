"""Data: packed token datasets and the data modules of the recipes."""

from lightning_hybrid.data.byte_text import ByteTextDataModule, PackedSequences, stdlib_text

__all__ = ["ByteTextDataModule", "PackedSequences", "stdlib_text"]
from lightning_hybrid.data.packed import PackedTokenDataModule, PackedTokenDataset  # noqa: E402

__all__ += ["PackedTokenDataModule", "PackedTokenDataset"]
