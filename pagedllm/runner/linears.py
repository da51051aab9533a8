"""How a freshly loaded model's linear layers (and, in batch-invariant mode, its norms and the
sampler's softmax) will run: packed for pagedllm's CPU GEMM or oneDNN, 16-bit weights on a CPU
without 16-bit arithmetic, or the batch-invariant kernels of one of two families (CPU: the
GEMM at any width; Triton: layers/triton_invariant.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm import _hugepages, _openmp, kernels
from pagedllm.config import EngineConfig
from pagedllm.layers.linear import Linear, pack_batch_invariant, pack_linears, use_triton_invariant
from pagedllm.layers.sampler import Softmax, torch_softmax
from pagedllm.logging_utils import init_logger

logger = init_logger(__name__)


def prepare_model(model: nn.Module, config: EngineConfig, device: torch.device,
                  backend: str) -> Softmax:
    """Set up ``model``'s fused ops and linears for ``config`` on ``device`` with attention
    backend ``backend``; returns the row softmax the sampler and prompt logprobs run."""
    kernels.set_fused_ops(model, config.fused_ops)
    kernels.set_fused_ops(model, config.fused_layers, "fused_layer")
    if config.batch_invariant and backend == "triton":
        from pagedllm.layers import triton_invariant

        n = use_triton_invariant(model)
        logger.info("batch-invariant mode: %d linear layers, the norms and the sampler's softmax "
                    "on Triton kernels with one tile shape for every batch", n)
        return triton_invariant.softmax
    if device.type == "cpu":
        _pack_cpu(model, config)
    return torch_softmax


def _pack_cpu(model: nn.Module, config: EngineConfig) -> None:
    w16 = config.model.weight_dtype
    w16_torch = None if w16 is None else getattr(torch, w16)
    if config.batch_invariant:
        if n := pack_batch_invariant(model, w16_torch):
            logger.info("batch-invariant mode: %d decoder layers have a linear width that "
                        "is not a multiple of 32 and run their modules one by one", n)
    elif config.linear_backend != "torch":
        if w16 is not None:
            logger.info(
                "dtype %s: this CPU has no %s arithmetic for pagedllm's kernels (ISA %s), "
                "so the linear weights stay %s (half the bytes a decode step reads) and "
                "activations and KV are float32: the fastest of the three measured on "
                "AVX2 (125M: 1.35x float32 weights, 7x %s activations on oneDNN; "
                "docs/features/cpu-isa.md)", w16, w16, kernels.isa(), w16, w16)
        pack_linears(model, config.linear_backend, w16_torch)
    if config.linear_backend != "torch" or config.batch_invariant:
        kinds = [m.kind for m in model.modules() if isinstance(m, Linear)]
        logger.debug("linear layers per kind: %s", {k: kinds.count(k) for k in set(kinds)})
    if (hint := _openmp.advice(torch.get_num_threads())) is not None:
        # pagedllm's own choice is a tuning detail; advice the user can act on is not
        logger.log(logging.DEBUG if hint == _openmp.CHOICE else logging.INFO, hint)
    logger.debug(_hugepages.CHOICE)
