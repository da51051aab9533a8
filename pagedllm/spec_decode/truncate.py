"""A draft for speculative decoding from the target itself: its first N decoder layers, with its
embeddings, final norm, LM head and tokenizer (a "truncated-layers copy"). It shares the
target's vocabulary by construction and agrees with it where the early layers already decide.

    python -m pagedllm.spec_decode.truncate SRC DST --layers N
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncate_layers(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write the first ``num_layers`` layers of the HF checkpoint ``src`` into ``dst``."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"--layers {num_layers} must be in [1, {cfg['num_hidden_layers']}] "
                         f"(the layers of {src})")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < num_layers:
                tensors[name] = t
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg["num_hidden_layers"] = num_layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "README.md", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    a = ap.parse_args(argv)
    print(truncate_layers(a.src, a.dst, a.layers))


if __name__ == "__main__":
    main()
