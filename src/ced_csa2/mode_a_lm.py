"""lm-eval's ``HFLM`` with Mode A's prefill skip: GSM8K the way a deployed CED model runs it.

Every request's context is prefilled by :class:`~ced_csa2.ced_runtime.CEDModeARuntime`
(layers ``1..split`` only; every attention layer above the cut gets its K/V from the maps;
non-attention layers above the cut start from a zero state), then the context's last token
and the continuation -- scored (``loglikelihood``) or greedily generated (``generate_until``)
-- run through all layers.  Everything else (prompts, few-shot contexts, stop sequences,
filters, tokenisation) is lm-eval's own, so Mode A's figures compare one to one with the
Mode B groups.  One request at a time: the skip prefill has no padding support.

    lm = ModeALM(CEDModeARuntime(model, plan, geo, parts), tokenizer)
    simple_evaluate(model=lm, tasks=[...])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from .ced_runtime import CEDModeARuntime


class ModeALM(HFLM):
    """An ``HFLM`` whose every forward over a context goes through the prefill skip.

    Parameters
    ----------
    runtime
        The Mode A runtime (model, covering plan, maps).
    tokenizer
        The model's tokenizer.
    """

    def __init__(self, runtime: CEDModeARuntime, tokenizer, **kwargs):
        super().__init__(pretrained=runtime.model, tokenizer=tokenizer, batch_size=1, **kwargs)
        self.runtime = runtime

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """``(sum log p(continuation | context), is greedy)`` per ``((ctx, cont), ctx_ids, cont_ids)``."""
        out = []
        for request, context, continuation in tqdm(requests, disable=disable_tqdm, desc="Mode A loglikelihood"):
            if len(context) + len(continuation) > self.max_length + 1:
                raise ValueError(f"Mode A request of {len(context) + len(continuation)} tokens exceeds the model's "
                                 f"{self.max_length}; lm-eval's left truncation would cut the skipped prompt")
            if len(context) < 2:
                raise ValueError("Mode A needs a context of at least 2 tokens (one to skip, one to predict from)")
            prompt = torch.tensor([context], device=self.device)
            cont = torch.tensor([continuation], device=self.device)
            logp = F.log_softmax(self.runtime.continuation_logits(prompt, cont)[0].float(), dim=-1)
            answer = (logp.gather(-1, cont[0, :, None]).sum().item(), bool((logp.argmax(-1) == cont[0]).all()))
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
