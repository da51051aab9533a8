"""LLM: the offline, vLLM-style API over one ``LLMEngine``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedllm.args import EngineArgs
from pagedllm.chat import load_chat_template, render_chat
from pagedllm.engine import LLMEngine, PromptType
from pagedllm.engine.drive import Submission, drive
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated tokens only
    cumulative_logprob: float
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first, beam_width of them


class LLM:
    """Offline generation, vLLM-style: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

    With no ``model`` the shipped default model (a small Llama trained on Python source) is used.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``kwargs``: the fields of ``pagedllm.EngineArgs`` (e.g. ``num_kv_blocks``,
        ``preheat_prompts``) and vLLM's other settings (``pagedllm.vllm_args``: accepted with a
        warning, or refused where they would change outputs); an unknown name is a TypeError
        naming the closest one."""
        args = EngineArgs.from_kwargs({"model": model, **kwargs}, "LLM")
        self.engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it; ``self.engine`` too)."""
        return self.engine

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, so the next prompts start cold (between benchmark
        runs, after changing adapters); False while a request holds blocks."""
        return self.engine.reset_prefix_cache()

    def get_prefix_cache_stats(self) -> dict[str, float]:
        return self.engine.prefix_cache_stats()

    def defragment(self) -> int:
        return self.engine.defragment()

    def kv_stats(self) -> dict[str, Any]:
        return self.engine.kv_stats()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without sampling_params: the model's generation_config.json
        defaults (temperature, top_p, ...) unless ``generation_config="vllm"``."""
        return self.engine.default_sampling_params()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None: the base model)
        per prompt; needs ``LLM(enable_lora=True)``."""
        plist = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} sampling_params for {len(plist)} prompts")
        prios = list(priority) if priority is not None else [0] * len(plist)
        if len(prios) != len(plist):
            raise ValueError(f"got {len(prios)} priorities for {len(plist)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(plist)
        else:
            loras = list(lora_request)
            if len(loras) != len(plist):
                raise ValueError(f"got {len(loras)} lora_requests for {len(plist)} prompts")
        final = {id(p): p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        add = self.engine.add_request
        return self._run([partial(add, prompt=p, params=final[id(sp)], priority=pr, lora_request=lr)
                          for p, sp, pr, lr in zip(plist, params, prios, loras)], use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or
        several (a list of them), rendered by the tokenizer's chat template or ``chat_template``
        (a file or the Jinja text); ``chat_template_kwargs`` go to the template (e.g.
        ``{"enable_thinking": False}``), ``tools`` too. ``continue_final_message=True`` (with
        ``add_generation_prompt=False``): the model continues the last message (a prefilled
        assistant reply) instead of starting a new one."""
        convs: list[Any] = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = load_chat_template(chat_template, "chat_template")
        prompts: list[PromptType] = [{"prompt_token_ids": render_chat(
            self.engine.tokenizer, list(conv), add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools, chat_template=template, chat_template_kwargs=chat_template_kwargs)}
            for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], beam_width: int,
                    max_tokens: int) -> list[BeamSearchOutput]:
        """Beam search, run in rounds of 1-token requests whose KV each round's requests start on
        (held blocks, shared by fork: ``pagedllm.engine.beam``). Returns,
        per prompt, ``beam_width`` sequences best first with their summed logprobs."""
        add = self.engine.add_beam_search
        outs = self._run([partial(add, prompt=p, beam_width=beam_width, max_tokens=max_tokens)
                          for p in _as_prompt_list(prompts)], use_tqdm=False)
        return [BeamSearchOutput(o.prompt_token_ids, [
            BeamSequence(c.token_ids, c.cumulative_logprob or 0.0, c.text) for c in o.outputs
        ]) for o in outs]

    def _run(self, adds: list[Callable[[str], None]], use_tqdm: bool) -> list[RequestOutput]:
        """Queue each request (``add(request_id)``) and step until all finished (``drive``); on
        error or interrupt nothing stays queued or holds blocks."""
        ids = [f"gen-{next(self._counter)}" for _ in adds]
        on_step = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
            wanted = set(ids)

            def on_step(outs: list[RequestOutput]) -> None:
                bar.update(sum(o.finished and o.request_id in wanted for o in outs))
        try:
            res = drive(self.engine, [Submission(rid, add) for rid, add in zip(ids, adds)],
                        on_step=on_step)
        finally:
            if use_tqdm:
                bar.close()
        return res.in_order(ids)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single list of token ids
    return items
