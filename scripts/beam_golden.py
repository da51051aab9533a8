"""Write tests/data/beam_search_golden.json: beam search outputs (token ids, exact scores) for
widths 1..20 on the tests' tiny Llama (fixed seed), made with the engine as it is checked out.

The file was written by the engine whose BeamSearch lived inside EngineCore (before the front-end
driver, issue #27); ``tests/test_beam_search.py`` holds the driver to it bit for bit.

    PYTHONPATH=$PWD python scripts/beam_golden.py [--out tests/data/beam_search_golden.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WIDTHS = list(range(1, 21))
MAX_TOKENS = 5
ENGINE = dict(block_size=4, num_kv_blocks=512, max_model_len=128)


def prompts() -> list[list[int]]:
    rng = random.Random(27)
    return [[rng.randrange(4, 512) for _ in range(rng.randrange(3, 14))] for _ in range(3)]


def run(model: Path) -> dict[str, Any]:
    from pagedllm import LLM, kernels
    from pagedllm._cpu import cpu_model

    llm = LLM(model=str(model), **ENGINE)
    ps = prompts()
    # the scores' bits are this CPU's and ISA's (tests/test_beam_search.py compares them exactly
    # only where both match)
    out: dict[str, Any] = {"engine": ENGINE, "max_tokens": MAX_TOKENS, "prompts": ps,
                           "cpu": cpu_model(), "isa": kernels.isa(), "widths": {}}
    for w in WIDTHS:
        res = llm.beam_search([{"prompt_token_ids": p} for p in ps], beam_width=w,
                              max_tokens=MAX_TOKENS)
        out["widths"][str(w)] = [[[s.token_ids, s.cumulative_logprob] for s in o.sequences]
                                 for o in res]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests/data/beam_search_golden.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_hf_model

    with tempfile.TemporaryDirectory() as d:
        data = run(make_hf_model(Path(d) / "llama", "llama", head_dim=32))
    Path(args.out).write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
