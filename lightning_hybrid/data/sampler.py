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
        # Ranges [start, end) of global positions in an epoch's permutation never trained on (a rolled-back window):
        # (epoch, start, end). Those known when an epoch's iteration starts are left out of it.
        self.skips: list[tuple[int, int, int]] = []
        self._base = (0, 0)  # (samples Lightning counted, permutation position) where this iteration started
        self._active: list[tuple[int, int]] = []
        self._iterated_epoch: Optional[int] = None
        self._counted: Optional[int] = None

    def resume_from(self, epoch: int, consumed_samples: int, counted: Optional[int] = None) -> None:
        """Start epoch ``epoch`` after ``consumed_samples`` positions of its permutation (over all ranks) were used
        or skipped; ``counted``: how many of them the loaded Trainer state counts as processed (default: all)."""
        if consumed_samples % self.num_replicas:
            raise ValueError(f"cannot resume after {consumed_samples} samples on {self.num_replicas} data-parallel "
                             f"ranks: the position must be a multiple of the number of ranks")
        self._resume = (epoch, consumed_samples)
        self._counted = consumed_samples if counted is None else counted

    def add_skip(self, epoch: int, start: int, end: int) -> None:
        """Record the global positions ``[start, end)`` of ``epoch`` as never to be trained on (from the next
        iteration of that epoch on: a range already passed in the running one is only recorded).

        Raises:
            ValueError: the range is empty or not on a boundary of this sampler's ranks.
        """
        if not 0 <= start < end or start % self.num_replicas or end % self.num_replicas:
            raise ValueError(f"skip range [{start}, {end}) must be non-empty and on multiples of the "
                             f"{self.num_replicas} data-parallel ranks")
        if (epoch, start, end) not in self.skips:
            self.skips.append((epoch, start, end))

    def position(self, counted: int) -> int:
        """The permutation position reached once Lightning counted ``counted`` samples of the running epoch (the
        ranges this iteration leaves out are passed over, not counted)."""
        left, pos = counted - self._base[0], self._base[1]
        for start, end in self._active:
            if end <= pos:
                continue
            if start >= pos:
                if pos + left <= start:
                    break
                left -= start - pos
            pos = end
        return pos + left

    def _skip(self) -> int:
        if self._resume is None or self._resume[0] != self.epoch:
            return 0
        return self._resume[1] // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        skip = self._skip()
        self._base = (self._counted or 0, skip * self.num_replicas) if skip else (0, 0)
        self._resume = None if skip else self._resume
        n = self.num_replicas
        self._active = sorted((s, e) for epoch, s, e in self.skips if epoch == self.epoch)
        self._iterated_epoch = self.epoch
        left_out = [(s // n, e // n) for s, e in self._active]
        for position, index in enumerate(super().__iter__()):
            if position >= skip and not any(s <= position < e for s, e in left_out):
                yield index

    def __len__(self) -> int:
        # The full epoch (Lightning counts a resumed epoch's batches from its start) less the ranges this epoch's
        # iteration leaves out (a range recorded after it started was read, and counts).
        active = self._active if self._iterated_epoch == self.epoch else [
            (s, e) for epoch, s, e in self.skips if epoch == self.epoch]
        return super().__len__() - sum((e - s) // self.num_replicas for s, e in active)


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
        sampler.resume_from(resume["epoch"], resume["samples_in_epoch"], resume.get("counted"))
        report_global_batch(resume.get("global_batch"), dataloader.batch_size, old.num_replicas, old.rank)
    for epoch, start, end in (resume or {}).get("skips", []):
        sampler.add_skip(epoch, start, end)
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


def data_position(trainer: Any, per_rank_batch_size: Optional[int], data_ranks: int,
                  sampler: Optional[ResumableDistributedSampler]) -> Optional[dict[str, int]]:
    """Where the data stands: ``samples_in_epoch``, the permutation position reached (the batch being finished
    included, left-out ranges passed over); ``counted``, the samples Lightning counted to get there; the seed; and
    ``skips``, the ranges never to train on (``[epoch, start, end]``, global positions: valid on any mesh).

    ``data_ranks``: the ranks that read their own samples, the sampler's ``num_replicas`` (dp; with torchft replica
    groups those of all groups, since each group reads its own share of every global batch)."""
    if trainer is None or per_rank_batch_size is None:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    counted = int(progress.processed) * per_rank_batch_size * data_ranks
    position = {"epoch": int(trainer.current_epoch), "samples_in_epoch": counted,
                "global_batch": per_rank_batch_size * data_ranks}
    if sampler is not None:
        position.update(seed=int(sampler.seed), samples_in_epoch=sampler.position(counted), counted=counted)
        if sampler.skips:
            position["skips"] = [list(s) for s in sampler.skips]
    return position
