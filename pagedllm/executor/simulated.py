"""SimulatedExecutor: the engine's step with the model taken out, for the planner's replay
(``pagedllm.planner.replay``).

The engine core runs as it does on a model: its scheduler, KV manager, memory policy, speculative
decoding's proposals and adaptive rule, n > 1 fan-out and LoRA residency all decide as they do,
because they are the engine's own. Only ``execute`` differs: no forward, no sampling. Each
sampling sequence gets its next token from ``tokens(seq_id)``, the tokens the workload says it
generates (a recorded run), or else a stand-in:

- recorded tokens: the token at the sequence's next output position. Proposals to verify are
  accepted while they equal the recorded tokens, as the runner's verification accepts them: for
  greedy rows by definition, and for sampled rows too with n-gram proposals (one token per
  position, so a rejected proposal is resampled to another token). A replay of a run's own
  tokens therefore takes that run's steps, preemptions and speculation.
- stand-ins: ``-1 - (q * max_model_len + position)`` for the q-th sequence seen: outside the
  vocabulary (no prompt contains one) and unique, so no two sequences share an output block and
  no n-gram proposal ever matches; a sequence recomputed after preemption finds its own cached
  blocks, as on the real engine.

``collective_rpc(ModelRunner.method, ...)`` runs the simulated counterpart of the few runner
methods the core calls outside a step (``add_lora``); any other is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor
from pagedllm.kv.plan import lora_blocks_per_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.runner.model_input import ModelInput, SeqInput
from pagedllm.runner.model_runner import RunnerOutput, SampledToken

TokenSource = Callable[[str], Sequence[int] | None]


class SimulatedExecutor(Executor):
    """No weights, no KV tensors: every rank's work is bookkeeping (module docstring)."""

    def __init__(self, config: EngineConfig, tokens: TokenSource | None = None) -> None:
        self.config = config
        self.tokens: TokenSource = tokens or (lambda _seq_id: None)
        self.num_blocks = 0
        self._stand_in: dict[str, int] = {}  # sequence id -> q, in the order first seen
        self._stride = config.scheduler.max_model_len

    def collective_rpc(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        impl = getattr(self, "_" + method.__name__, None)
        if impl is None:
            raise NotImplementedError(f"the simulated executor (the planner's replay) does not "
                                      f"run ModelRunner.{method.__name__}")
        return [impl(*args, **kwargs)]

    def _add_lora(self, req: LoRARequest) -> int:
        """An adapter of ``max_lora_rank`` on every projection, as the plan sizes one."""
        cfg = self.config
        assert cfg.lora is not None
        return lora_blocks_per_adapter(cfg.model, cfg.cache, cfg.lora.max_lora_rank)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute(self, step: ModelInput) -> RunnerOutput:
        out = RunnerOutput()
        for s in step.seqs:
            if s.samples:
                accepted, token = self._next_tokens(s)
                out.sampled[s.request_id] = token
                if s.spec_token_ids:
                    out.accepted[s.request_id] = accepted
        return out

    def _next_tokens(self, s: SeqInput) -> tuple[list[SampledToken], SampledToken]:
        """The proposals the recorded tokens accept, and the token after them."""
        pos = s.num_output_tokens
        recorded = self.tokens(s.request_id)
        accepted = []
        for tok in s.spec_token_ids:
            if recorded is None or pos >= len(recorded) or recorded[pos] != tok:
                break
            accepted.append(SampledToken(tok))
            pos += 1
        if recorded is not None and pos < len(recorded):
            return accepted, SampledToken(int(recorded[pos]))
        q = self._stand_in.setdefault(s.request_id, len(self._stand_in))
        return accepted, SampledToken(-1 - (q * self._stride + pos))

    def release(self, request_ids: list[str]) -> None:
        """Finished sequences keep their stand-in index: an id is never reused in a replay."""

    def shutdown(self) -> None:
        pass

    @property
    def memory_profile(self) -> None:
        return None
