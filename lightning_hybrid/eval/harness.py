"""``ShardedLM``: lm-evaluation-harness's language-model interface backed by the model as the strategy sharded it.

The harness builds the requests (prompts, few-shot contexts, answer choices) and computes the metrics; this class
turns them into token batches for :class:`~lightning_hybrid.eval.scoring.ShardedScorer` the way the harness's own
Hugging Face model (``hf``) does: the same tokenization (``TemplateLM``), the same truncation to ``max_length``,
requests sorted longest first and batched by the harness's ``Collator``, the same rolling windows for perplexity,
the same stop sequences and post-processing for generation. Decoding is greedy (no sampling); a task that samples is
refused in one line.

Every rank of the job runs the harness on the same requests (the harness sees one process: ``rank`` 0 of
``world_size`` 1); the scorer spreads the batches over the data-parallel replicas and gathers the answers, so every
rank returns the same results.

Importing this module imports lm-evaluation-harness: ``pip install 'lightning-hybrid[eval]'``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from lm_eval import utils as harness_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)

from lightning_hybrid.eval.scoring import GenerationBatch, ShardedScorer, eval_layout

__all__ = ["ShardedLM", "DEFAULT_BATCH_SIZE", "sampling_error"]

DEFAULT_BATCH_SIZE = 8  # rows per forward pass without a pipeline (with one: its micro-batches per step)


def sampling_error(task: Optional[str], gen_kwargs: dict) -> Optional[str]:
    """Why a generation request cannot run here (one line naming the task), or ``None``: decoding is greedy only."""
    kwargs = normalize_gen_kwargs(dict(gen_kwargs))
    if not kwargs.get("do_sample"):
        return None
    return (f"task {task!r} samples its generations (do_sample=True, temperature={kwargs.get('temperature')}); "
            f"lightning-hybrid's evaluation decodes greedily only: set do_sample: false in the task's "
            f"generation_kwargs, or evaluate an exported model (export-hf) with the harness's hf model")


class ShardedLM(TemplateLM):
    """An lm-evaluation-harness model (``LM``) backed by a LightningModule on its strategy's mesh (tp x pp x dp x cp).

    ``loglikelihood`` and ``loglikelihood_rolling`` score the requests with forward passes through the same schedule
    as validation; ``generate_until`` decodes greedily, one forward pass per new token (no key/value cache). Results
    are gathered so every rank returns the same list.

    Args:
        module: the LightningModule (:class:`~lightning_hybrid.models.CausalLM`), set up by its Trainer.
        tokenizer: a Hugging Face tokenizer (``transformers.AutoTokenizer``) of the model's vocabulary.
        strategy: the Trainer's strategy (``None``: one process holding the whole model).
        batch_size: rows per forward pass; ``None``: the pipeline's micro-batches per step, or 8 without one.
        max_length: longest input in tokens (longer ones are cut from the left, as the harness does); ``None``: the
            model config's ``max_position_embeddings``. Set it to the trained sequence length.
        max_gen_toks: tokens generated at most per request, unless the task says otherwise.
        add_bos_token: as the harness's ``hf`` model: ``None`` leaves it to the tokenizer.

    Raises:
        ValueError: a bad size.
    """

    def __init__(self, module: Any, tokenizer: Any, strategy: Any = None, batch_size: Optional[int] = None,
                 max_length: Optional[int] = None, max_gen_toks: int = 256,
                 add_bos_token: Optional[bool] = None) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("max_length", max_length), ("max_gen_toks", max_gen_toks)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.module, self.tokenizer, self.add_bos_token = module, tokenizer, add_bos_token
        layout = eval_layout(strategy, module.device)
        rows = batch_size or (layout.microbatches if layout.microbatches > 1 else DEFAULT_BATCH_SIZE)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.scorer = ShardedScorer(module, layout, rows, pad if pad is not None else 0)
        self._max_length = max_length or resolve_max_length(getattr(module, "config", None), tokenizer)
        self._max_gen_toks = max_gen_toks
        self._device = module.device

    # ------------------------------------------------------------------ what the harness asks of a model

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # the token a context-free request is conditioned on: BOS where the tokenizer has one, else EOS (as ``hf``)
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.scorer.batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs: Any) -> list[int]:
        options = {}
        if add_special_tokens is not None or self.add_bos_token is not None:
            options["add_special_tokens"] = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            options["add_special_tokens"] = False  # the string brings its own BOS
        tokens = self.tokenizer.encode(string, **options)
        return tokens[-left_truncate_len:] if left_truncate_len else tokens

    def tok_decode(self, tokens: Any, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """``(log-likelihood, greedy)`` of each ``(key, context tokens, continuation tokens)``, in request order."""
        order = Collator(requests, sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])))
        chunks = list(order.get_batched(n=self.batch_size))
        batches = []
        for chunk in chunks:
            rows = []
            for _, context, continuation in chunk:
                if not context or not continuation or len(continuation) > self.max_length:
                    raise ValueError(f"a request has {len(context)} context and {len(continuation)} continuation "
                                     f"tokens; each needs at least one and the continuation at most "
                                     f"max_length={self.max_length}")
                whole = (context + continuation)[-(self.max_length + 1):]  # cut from the left, as ``hf`` does
                rows.append((whole[:-1], continuation))
            batches.append(rows)
        answers = self.scorer.loglikelihood(batches)
        for (key, _, _), answer in zip((req for chunk in chunks for req in chunk), answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return order.get_original(answers)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, in disjoint windows of ``max_length`` tokens each given the most context
        that fits (the harness's rolling windows); the windows of all documents are batched together."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (text,) in (req.args for req in requests):
            rolling = harness_utils.get_rolling_token_windows(token_list=self.tok_encode(text),
                                                              prefix_token=self.prefix_token_id,
                                                              max_seq_len=self.max_length, context_len=1)
            parts = [harness_utils.make_disjoint_window(window) for window in rolling]
            windows += [(None, context, continuation) for context, continuation in parts]
            counts.append(len(parts))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True)
        totals, start = [], 0
        for request, count in zip(requests, counts):
            total = sum(score for score, _ in scores[start:start + count])
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
        return totals

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (the task's ``until`` and the EOS text).

        Raises:
            ValueError: a request asks for sampling (one line naming its task).
        """
        for request in requests:
            error = sampling_error(request.task_name, request.args[1])
            if error:
                raise ValueError(error)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        order = Collator([req.args for req in requests], sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
                         group_by="gen_kwargs", group_fn=lambda args: args[1])
        chunks = list(order.get_batched(n=self.batch_size))
        batches, stops = [], []
        for chunk in chunks:
            kwargs = normalize_gen_kwargs(dict(chunk[0][1]), self.max_gen_toks)  # one group: the same kwargs
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in max_length={self.max_length}")
            contexts = [self.tok_encode(context, left_truncate_len=self.max_length - max_new) for context, _ in chunk]
            batches.append(GenerationBatch(contexts, max_new, functools.partial(self._finished, until)))
            stops.append(until)
        generated = iter(self.scorer.generate(batches))
        texts = []
        for chunk, until in zip(chunks, stops):
            for context, gen_kwargs in chunk:
                text = postprocess_generated_text(self.tok_decode(next(generated)), until, None)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                texts.append(text)
        return order.get_original(texts)

    def _finished(self, until: list[str], tokens: list[int]) -> bool:
        if tokens and tokens[-1] == self.eot_token_id:
            return True
        text = self.tok_decode(tokens, skip_special_tokens=False)
        return any(stop and stop in text for stop in until)

    def get_model_info(self) -> dict[str, Any]:
        """What the harness records of the model in its results (``config``)."""
        return {"model_class": type(self.module).__name__, "dtype": str(next(self.module.parameters()).dtype),
                "batch_size": self.batch_size, "max_length": self.max_length, "torch": torch.__version__}
