"""A distributed sampler that can resume mid-epoch, also on a different number of data-parallel ranks.

Like ``DistributedSampler`` (same permutation for the same seed and epoch, rank ``r`` of ``n`` takes
positions ``r, r+n, ...``), so global batch ``k`` is block ``k`` of the epoch's permutation whatever
``n`` is. Resuming after ``S`` samples of the epoch were consumed globally, each rank skips the first
``S / n`` of its positions: the run continues with exactly the global batches it would have seen
without the interruption, even when ``n`` changed (the global batch size must stay the same).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch.utils.data import Dataset, DistributedSampler

from lightning_hybrid.distributed.elastic import report_global_batch

__all__ = ["ResumableDistributedSampler", "resumable_dataloader", "data_position", "batch_size_of"]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` with a start position within an epoch.

    Raises:
        ValueError: the resume position does not fall on a boundary of this sampler's ranks.
    """

    def __init__(self, dataset: Dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._resume: Optional[tuple[int, int]] = None  # (epoch, samples consumed in it, globally)

    def resume_from(self, epoch: int, consumed_samples: int) -> None:
        """Start epoch ``epoch`` after ``consumed_samples`` samples (over all ranks) were already used."""
        if consumed_samples % self.num_replicas:
            raise ValueError(f"cannot resume after {consumed_samples} samples on {self.num_replicas} data-parallel "
                             f"ranks: the position must be a multiple of the number of ranks")
        self._resume = (epoch, consumed_samples)

    def _skip(self) -> int:
        if self._resume is None or self._resume[0] != self.epoch:
            return 0
        return self._resume[1] // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        skip = self._skip()
        self._resume = None if skip else self._resume
        for position, index in enumerate(super().__iter__()):
            if position >= skip:
                yield index

    # __len__ stays the full epoch: Lightning counts a resumed epoch's batches from its start.


def resumable_dataloader(dataloader: Any, resume: Optional[dict[str, int]]) -> tuple[Any, Optional[Any], bool]:
    """Replace the ``DistributedSampler`` Lightning gave a DataLoader by a :class:`ResumableDistributedSampler`.

    Args:
        dataloader: what Lightning hands the strategy's ``process_dataloader``.
        resume: the data position of a loaded checkpoint (applied to a shuffled, i.e. training, loader only).

    Returns:
        (the DataLoader, its new sampler when it is the training one else ``None``, whether ``resume`` was used).
    """
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DataLoader

    if not isinstance(dataloader, DataLoader) or type(dataloader.sampler) is not DistributedSampler:
        return dataloader, None, False
    old = dataloader.sampler
    resume = resume if old.shuffle else None
    # A resumed run keeps the permutation of the run it continues, whatever seed it was started with.
    seed = resume.get("seed", old.seed) if resume else old.seed
    sampler = ResumableDistributedSampler(old.dataset, num_replicas=old.num_replicas, rank=old.rank,
                                          shuffle=old.shuffle, seed=seed, drop_last=old.drop_last)
    if resume is not None:
        sampler.resume_from(resume["epoch"], resume["samples_in_epoch"])
        report_global_batch(resume.get("global_batch"), dataloader.batch_size, old.num_replicas, old.rank)
    loader = _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING if old.shuffle else None)
    return loader, sampler if old.shuffle else None, resume is not None


def batch_size_of(batch: Any, loader: Any) -> Optional[int]:
    """The per-rank batch size the data position counts in.

    Lightning's ``extract_batch_size`` (the first dimension of the batch's tensors) when the batch has tensors; for
    a batch without any (strings tokenized in ``training_step``) the ``batch_size`` of the training ``loader``;
    ``None`` when neither tells (then no data position is recorded; training is not affected).
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return extract_batch_size(batch)
    except MisconfigurationException:  # "We could not infer the batch_size from the batch"
        size = getattr(loader, "batch_size", None)
        return size if isinstance(size, int) and not isinstance(size, bool) else None


def data_position(trainer: Any, per_rank_batch_size: Optional[int], dp: int,
                  sampler: Optional[ResumableDistributedSampler]) -> Optional[dict[str, int]]:
    """Global samples of the current epoch consumed so far (including the batch being finished), and the seed."""
    if trainer is None or per_rank_batch_size is None:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    position = {"epoch": int(trainer.current_epoch),
                "samples_in_epoch": int(progress.processed) * per_rank_batch_size * dp,
                "global_batch": per_rank_batch_size * dp}
    if sampler is not None:
        position["seed"] = int(sampler.seed)
    return position
