"""A datamodule with a fixed global batch for auto-layout runs: the per-rank batch follows the dp the planner chose."""

from __future__ import annotations

import lightning as L

from helpers.equivalence import GLOBAL_BATCH, SEQ_LEN, make_dataset


class GlobalBatchData(L.LightningDataModule):
    """The equivalence problem's data (:func:`helpers.equivalence.make_dataset`), ``GLOBAL_BATCH`` sequences a step."""

    seq_len = SEQ_LEN
    global_batch_size = GLOBAL_BATCH

    def _loaders(self):
        return make_dataset(GLOBAL_BATCH // self.trainer.strategy.dims.dp)

    def train_dataloader(self):
        return self._loaders()[0]

    def val_dataloader(self):
        return self._loaders()[1]
