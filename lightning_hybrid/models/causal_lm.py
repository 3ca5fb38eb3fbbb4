"""``CausalLM``: the LightningModule for next-token training of a decoder of any family the core computes."""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_hybrid.init_weights import init_parameters
from lightning_hybrid.models.decoder.config import DecoderConfig, flops_per_token, parallel_spec
from lightning_hybrid.models.decoder.model import Decoder, parameter_init
from lightning_hybrid.models.decoder.moe import METRICS, moe_layers, step_metrics
from lightning_hybrid.models.spec import ParallelSpec, token_mean_loss

__all__ = ["CausalLM", "split_batch", "position_ids_of", "LR_SCHEDULES"]

LR_SCHEDULES = ("cosine", "linear", "constant")


def split_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)`` from a dict with those keys or a 2-tuple/list.

    Raises:
        ValueError: the batch has another form.
    """
    if isinstance(batch, dict) and "input_ids" in batch and "labels" in batch:
        return batch["input_ids"], batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f"a batch must be a dict with 'input_ids' and 'labels' or a tuple (input_ids, labels); "
                     f"got {type(batch).__name__}")


def position_ids_of(batch: Any) -> Optional[Tensor]:
    """The batch's ``position_ids`` (documents packed in a row, restarting at 0 at each), or ``None``."""
    return batch.get("position_ids") if isinstance(batch, dict) else None


def lr_lambda(step: int, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """LR multiplier at ``step``: linear warmup, then cosine or linear decay to ``min_lr_ratio``, or constant."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLM(pl.LightningModule):
    """Next-token training of a decoder (Qwen2 / Qwen2.5, Llama 3.x, Qwen3, Mistral) with AdamW and a warmup + decay
    schedule.

    The model is built in ``configure_model`` on the meta device; under
    :class:`~lightning_hybrid.HybridParallelStrategy` it is sharded before any weight is allocated, so
    a 72B model never exists whole on one rank. Under any other strategy it is materialized and
    initialized on the module's device with the same mesh-independent initialization.

    Batches are ``{"input_ids", "labels"}`` dicts or ``(input_ids, labels)`` tuples with labels already
    shifted (``-100`` ignored). The loss is the mean over all label tokens of the global batch.

    Args:
        model: preset name (``"tiny"``, ``"qwen2.5-72b"``, ``"llama3.1-70b"``, ``"qwen3-32b"``, ...), a
            :class:`~lightning_hybrid.models.DecoderConfig` (``Qwen2Config``), or a Hugging Face folder or repo id
            with a ``config.json`` (its ``model_type`` picks the family).
        lr: peak learning rate.
        weight_decay: AdamW weight decay, applied to matrices only (not to norms and biases).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup steps.
        max_steps: length of the decay; ``None`` uses the Trainer's number of optimizer steps.
        lr_schedule: ``"cosine"``, ``"linear"`` or ``"constant"`` after warmup.
        min_lr_ratio: final LR as a fraction of ``lr``.
        init_seed: seed of the weight initialization; ``None`` uses the global seed (``seed_everything``).
        init_from_hf: a Hugging Face repo id or local folder to load the initial weights from (each rank reads
            only its slices).

    Raises:
        ValueError: an unknown preset or schedule, or a ``config.json`` this core does not compute exactly.
    """

    def __init__(
        self,
        model: Union[str, DecoderConfig] = "tiny",
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        max_steps: Optional[int] = None,
        lr_schedule: str = "cosine",
        min_lr_ratio: float = 0.1,
        init_seed: Optional[int] = None,
        init_from_hf: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.config = DecoderConfig.resolve(model)
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={lr_schedule!r} is not supported; use one of {', '.join(LR_SCHEDULES)}")
        self.save_hyperparameters(ignore=["model"])
        self.hparams["model"] = self.config.to_dict()
        self.model: Optional[Decoder] = None
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

    # ------------------------------------------------------------------ declared structure

    def parallel_spec(self) -> ParallelSpec:
        """The model's parts and TP plan (read from the config; available before the model is built)."""
        return parallel_spec(self.config)

    def num_blocks(self) -> int:
        """Number of decoder blocks (what the pipeline splits)."""
        return self.config.num_hidden_layers

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token at ``seq_len`` (:func:`~lightning_hybrid.models.decoder.flops_per_token`)."""
        return flops_per_token(self.config, seq_len)

    def _declared_runner(self) -> Optional[Any]:
        """The strategy's runner for this declared model (a pipeline), or ``None`` when the model runs as is.

        The one question this module asks a strategy, through its public ``declared_model_runner()``; a
        strategy without that method (single device, DDP, ...) runs the model plainly.
        """
        ask = getattr(self._strategy(), "declared_model_runner", None)
        return ask() if callable(ask) else None

    def _strategy(self) -> Optional[Any]:
        """The Trainer's strategy, or ``None`` while this module is not attached to a Trainer."""
        try:
            return self.trainer.strategy
        except RuntimeError:  # Lightning's `trainer` raises when none is attached
            return None

    def init_seed(self) -> int:
        if self.hparams.init_seed is not None:
            return int(self.hparams.init_seed)
        return int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed() % (1 << 63)))

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            model = Decoder(self.config)
        strategy = self._strategy()
        # A strategy that runs declared models shards the meta-device model before allocating it.
        if not callable(getattr(strategy, "declared_model_runner", None)):
            model.to_empty(device=self.device)
            if self.config.tie_word_embeddings:  # to_empty breaks the tie; restore it
                model.lm_head.weight = model.embed_tokens.weight
            self.initialize_parameters(model, self.init_seed())
        self.model = model

    def initialize_parameters(self, model: torch.nn.Module, seed: int) -> None:
        """Fill the (possibly sharded, possibly one pipeline stage's) materialized parameters of ``model``.

        Random, mesh-independent initialization from ``seed``, or the Hugging Face weights of
        ``init_from_hf`` when given (each rank reads only its own slices).
        """
        if self.hparams.get("init_from_hf"):
            from lightning_hybrid.models.decoder.hf import load_hf_weights

            load_hf_weights(model, self.hparams.init_from_hf, self.config)
        else:
            init_parameters(model, seed, functools.partial(parameter_init, self.config))
        for layer in moe_layers(model).values():  # buffers are not parameters: the routing bias starts at zero
            if layer.gate.e_score_correction_bias is not None:
                layer.gate.e_score_correction_bias.zero_()

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        assert self.model is not None, "call configure_model() first"
        return self.model(input_ids, position_ids)

    # ------------------------------------------------------------------ steps

    def _global_loss(self, input_ids: Tensor, labels: Tensor, train: bool,
                     position_ids: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        """(loss to backpropagate, global mean loss for logging, global label-token count).

        Each rank backpropagates its label-token sum as its part of the global token mean
        (:func:`~lightning_hybrid.models.spec.token_mean_loss`, which the pipeline's runner uses per micro-batch).
        One all-reduce gives both the global sum (for logging) and the global count; ranks that hold the same data
        (tensor/pipeline peers) are divided out.
        """
        pipeline = self._declared_runner()
        if pipeline is not None:
            return pipeline(input_ids, labels, train=train, position_ids=position_ids)
        logits = self.model(input_ids, position_ids)
        loss_sum, count = self.model.loss_sum(logits, labels)
        strategy = self.trainer.strategy
        dp = strategy.distributed_sampler_kwargs["num_replicas"] if strategy.world_size > 1 else 1
        stats = torch.stack([loss_sum.detach().float(), count.float()])
        if strategy.world_size > 1:
            stats = strategy.reduce(stats, reduce_op="sum") * (dp / strategy.world_size)
        return token_mean_loss(loss_sum, stats[1], dp), token_mean_loss(stats[0], stats[1]), stats[1]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels = split_batch(batch)
        if self._declared_runner() is None:  # a pipeline weighs its micro-batches' balancing gradients itself
            for layer in moe_layers(self.model).values():
                layer.grad_scale = 1.0 / self.trainer.accumulate_grad_batches
        loss, value, _ = self._global_loss(input_ids, labels, train=True, position_ids=position_ids_of(batch))
        self.log("train_loss", value, prog_bar=True)
        self.log("train_ppl", torch.exp(value))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        input_ids, labels = split_batch(batch)
        _, value, count = self._global_loss(input_ids, labels, train=False, position_ids=position_ids_of(batch))
        # The value is already the global batch mean; weight it by its tokens for the epoch mean.
        self.val_loss.update(value, weight=count)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", torch.exp(loss))
        self.val_loss.reset()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        input_ids, labels = split_batch(batch)
        _, value, count = self._global_loss(input_ids, labels, train=False, position_ids=position_ids_of(batch))
        self.test_loss.update(value, weight=count)

    def on_test_epoch_end(self) -> None:
        loss = self.test_loss.compute()
        self.log("test_loss", loss)
        self.log("test_ppl", torch.exp(loss))
        self.test_loss.reset()

    def predict_step(self, batch: Any, batch_idx: int) -> Optional[Tensor]:
        """Logits of a batch (a tensor of ids, a dict with ``input_ids`` or a tuple starting with them).

        With a pipeline, the rank holding the last stage returns them and the other ranks ``None``.
        """
        position_ids = position_ids_of(batch)
        if isinstance(batch, dict):
            input_ids = batch["input_ids"]
        elif isinstance(batch, (tuple, list)):
            input_ids = batch[0]
        else:
            input_ids = batch
        pipeline = self._declared_runner()
        if pipeline is not None:
            return pipeline.logits(input_ids, position_ids)
        return self.model(input_ids, position_ids)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        # With a pipeline the schedule computes the gradients inside training_step, before Lightning would
        # zero them; the strategy zeroes them after each optimizer step instead.
        if self._declared_runner() is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    # ------------------------------------------------------------------ mixture of experts

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Log each sparse layer's step (:data:`~lightning_hybrid.models.decoder.moe.METRICS`): its load balance, its
        load-balancing loss and its dropped tokens, gathered from every pipeline stage (one small sum over the
        ranks), and their summary (``moe/aux_loss``: the mean over the layers, ``moe/load_max_over_mean``: the
        worst layer)."""
        if not self.config.has_experts:
            return
        table = step_metrics(moe_layers(self.model), self.config.num_hidden_layers, self.device)
        strategy = self._strategy()
        if strategy is not None and strategy.world_size > 1:
            table = strategy.reduce(table, reduce_op="sum")
        present = table[:, -1] > 0
        values = table[:, :-1] / table[:, -1:].clamp(min=1)
        for index in present.nonzero().flatten().tolist():
            for name, value in zip(METRICS, values[index]):
                self.log(f"moe/layer_{index}/{name}", value.float())
        if present.any():
            self.log("moe/aux_loss", values[present, 1].mean().float())
            self.log("moe/load_max_over_mean", values[present, 0].max().float())
            self.log("moe/dropped_tokens", values[present, 2].sum().float())

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        for layer in moe_layers(self.model).values():  # the routing bias moves after the step; statistics restart
            layer.end_step()

    # ------------------------------------------------------------------ optimization

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for param in self.parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
        )
        max_steps = hp.max_steps
        if max_steps is None:
            max_steps = (self.trainer.max_steps if self.trainer.max_steps > 0
                         else int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_lambda(step, hp.warmup_steps, max_steps, hp.lr_schedule, hp.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
