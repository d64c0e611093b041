"""lm-eval's ``HFLM`` for the ``eval_gsm8k`` stage: generation shared out over ranks, and Mode A.

:class:`DataParallelLM` -- ``HFLM`` that, under a process group (``distributed.nproc > 1``),
generates each rank's contiguous share of the single-process batches and gathers the
texts, so every rank's lm-eval sees exactly one process's answers.

:class:`ModeALM` -- the same, with Mode A's prefill skip: GSM8K the way a deployed CED
model runs it.  Every request's context is prefilled by
:class:`~ced_csa2.ced_runtime.CEDModeARuntime` (layers ``1..split`` only; every attention
layer above the cut gets its K/V from the maps; non-attention layers above the cut start
from a zero state), then the context's last token
and the continuation -- scored (``loglikelihood``) or greedily generated (``generate_until``)
-- run through all layers.  Everything else (prompts, few-shot contexts, stop sequences,
filters, tokenisation) is lm-eval's own, so Mode A's figures compare one to one with the
Mode B groups.  One request at a time: the skip prefill has no padding support.

    lm = ModeALM(CEDModeARuntime(model, plan, geo, parts), tokenizer)
    simple_evaluate(model=lm, tasks=[...])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lm_eval.models.huggingface import HFLM

from ..ced_runtime import CEDModeARuntime
from ..pipeline import distributed
from ..pipeline.progress import Progress
from ..plan import LayerPlan
from . import generation
from .scoring import BLOCK_TOKENS, continuation_logprob


class DataParallelLM(HFLM):
    """``HFLM`` (on a model already built) whose ``generate_until`` is sharded by whole batch over the ranks.

    Every rank runs lm-eval's ``simple_evaluate`` as one process would (``rank`` 0,
    ``world_size`` 1 as lm-eval sees it: the same requests, filters and metrics); only the
    model calls are shared out.  The requests are put in the batches ``HFLM.generate_until``
    forms in one process (:meth:`single_process_batches`); rank ``r`` generates a contiguous
    run of those batches, unchanged (:func:`ced_csa2.pipeline.distributed.bounds`), and the texts of all
    ranks are gathered in request order on every rank.  A batch's padding -- hence its
    floating-point results -- is the single-process one, so the generated text is too.
    Without a process group this is ``HFLM``.

    Why not lm-eval's own multi-process path.  (1) ``HFLM`` sets up data parallelism only for
    a model it loads by name, and only with more than one GPU (``gpus > 1`` in its
    ``__init__``; on CPU it never does); a model passed in -- ours runs inside the Mode A/B
    runtimes and their hooks -- is always rank 0 of 1.  (2) With ``_rank`` / ``_world_size``
    set by hand (and ``all_gather`` / ``barrier``, which call an ``accelerate.Accelerator``,
    replaced), ``evaluator.evaluate`` would shard: it deals the *documents* out strided
    (``doc_iterator(rank, world_size)``), each rank sorts and batches its own, pads the short
    ranks with copies of a request, and gathers the per-sample logs and metrics to rank 0.
    But then every batch differs from the single-process one, and a prompt left-padded to
    another length gives other logits (measured on the tiny Qwen3.5 in fp32: 3.6e-7 on a
    prompt's first step), so greedy generation may differ from one process's at a near-tie.
    Sharding whole single-process batches keeps the results identical for any number of
    processes.
    (3) ``accelerate launch`` is not needed: the process group is torchrun's
    (:func:`ced_csa2.pipeline.distributed.relaunch`), gloo on CPU.
    """

    _through: tuple | None = None  # (plan, group, parts, kv_format, seen) inside through_cache

    @contextmanager
    def through_cache(self, plan: LayerPlan, group: str, parts, kv_format: str | None) -> Iterator[dict]:
        """Generate every batch of ``group`` through a fresh cache that holds its bytes.

        ``HFLM.generate_until``'s batches are left-padded; ``generate`` runs on
        :func:`~ced_csa2.eval.generation.group_cache`'s cache (its context open around the batch), and
        after the batch the cache's bytes are checked against the accounting, to the byte
        (:func:`~ced_csa2.eval.generation.check_bytes`: a mismatch raises, naming the group).

        Yields
        ------
        dict
            Filled as batches run: ``cache`` (the cache in words), ``batches``, ``bytes_per_position``
            (used K/V bytes per cached position and row, the last batch's; pads included).
        """
        seen: dict = {"cache": None, "batches": 0, "bytes_per_position": None}
        self._through = (plan, group, parts, kv_format, seen)
        try:
            yield seen
        finally:
            self._through = None

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        if self._through is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        plan, group, parts, kv_format, seen = self._through
        built = generation.group_cache(self.model, plan, group, parts, kv_format)
        with built.open():
            out = super()._model_generate(context, max_length, stop, cache=built.cache, **generation_kwargs)
        run = generation.checked_run(self.model, plan, group, group, built.storage, out[:, context.shape[1]:],
                                     built.cache, built.kind, rank=built.rank)
        seen.update(cache=built.kind, batches=seen["batches"] + 1, bytes_per_position=run.used_per_token)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if distributed.world_size() == 1:
            return super().generate_until(requests, disable_tqdm)
        batches = self.single_process_batches(requests)
        lo, hi = distributed.bounds(len(batches))
        mine = [i for batch in batches[lo:hi] for i in batch]
        # HFLM re-sorts this run (stably, by the same key) and cuts it into the same batches.
        texts = super().generate_until([requests[i] for i in mine], disable_tqdm or not distributed.is_main())
        out: list = [None] * len(requests)
        for indices, part in distributed.gather((mine, texts)):
            for i, text in zip(indices, part):
                out[i] = text
        return out

    def single_process_batches(self, requests) -> list[list[int]]:
        """Indices of ``requests`` in the batches, and the order, in which ``HFLM.generate_until`` runs them.

        lm-eval's own ``Collator`` with ``HFLM.generate_until``'s key: grouped by generation
        settings, longest context first (ties by context), ``batch_size`` at a time.
        """
        from lm_eval.models.utils import Collator

        order = Collator([(*r.args, i) for i, r in enumerate(requests)], group_by="gen_kwargs",
                         sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]), group_fn=lambda a: a[1])
        return [[a[2] for a in batch] for batch in order.get_batched(n=self.batch_size)]


class ModeALM(DataParallelLM):
    """An ``HFLM`` whose every forward over a context goes through the prefill skip.

    Parameters
    ----------
    runtime
        The Mode A runtime (model, covering plan, maps).
    tokenizer
        The model's tokenizer.
    block_tokens
        Continuation positions per LM-head block when scoring (:func:`~ced_csa2.eval.scoring.continuation_logprob`).
    """

    def __init__(self, runtime: CEDModeARuntime, tokenizer, *, block_tokens: int = BLOCK_TOKENS, **kwargs):
        super().__init__(pretrained=runtime.model, tokenizer=tokenizer, batch_size=1, **kwargs)
        self.runtime = runtime
        self.block_tokens = block_tokens

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """``(sum log p(continuation | context), is greedy)`` per ``((ctx, cont), ctx_ids, cont_ids)``."""
        out = []
        for request, context, continuation in Progress(requests, disable=disable_tqdm, desc="Mode A loglikelihood"):
            if len(context) + len(continuation) > self.max_length + 1:
                raise ValueError(f"Mode A request of {len(context) + len(continuation)} tokens exceeds the model's "
                                 f"{self.max_length}; lm-eval's left truncation would cut the skipped prompt")
            if len(context) < 2:
                raise ValueError("Mode A needs a context of at least 2 tokens (one to skip, one to predict from)")
            prompt = torch.tensor([context], device=self.device)
            cont = torch.tensor([continuation], device=self.device)
            hidden = self.runtime.continuation_hidden(prompt, cont)[0]
            answer = continuation_logprob(self.runtime.model, hidden, cont[0], self.block_tokens)
            out.append(answer)
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return out

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """Greedy continuation of ``context`` ``(1, T)`` up to ``max_length`` tokens or a stop sequence.

        Returns ``(1, T + n)``: the context and the new tokens, as ``model.generate`` does.
        """
        if generation_kwargs.get("do_sample") or generation_kwargs.get("temperature", 0.0) > 0:
            raise ValueError("ModeALM decodes greedily; sampling (do_sample / temperature > 0) is not supported")
        if context.shape[0] != 1 or context.shape[1] < 2:
            raise ValueError(f"ModeALM generates for one unpadded context of >= 2 tokens, got {tuple(context.shape)}")
        eos = self.tokenizer.eos_token_id

        def done(new: torch.Tensor) -> bool:
            return new[0, -1].item() == eos or any(s in self.tok_decode(new[0].tolist()) for s in stop)

        new = self.runtime.generate(context, max_length - context.shape[1], stop=done)
        return torch.cat([context, new], dim=1)
