"""A draft model for speculative decoding made from the target itself: its first ``--layers``
decoder layers, its final norm and its lm_head (tied or not), saved as an HF folder with the
target's tokenizer files. Nothing to download, and the vocabulary matches by construction;
the draft is untrained as a shallow model, so expect low acceptance (it measures the path).

    python -m bench.truncated_draft --layers 8 /tmp/smollm2-draft8
    python -m bench.spec_decode --draft-model /tmp/smollm2-draft8
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncate(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """Write ``out_dir``: ``model_dir``'s config with ``num_layers`` layers, the weights of its
    layers ``0..num_layers-1`` and of everything outside the layers, and its other files."""
    config = json.loads((model_dir / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"--layers must be in 1..{total} (the model's num_hidden_layers), got {num_layers}")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no .safetensors weights to truncate")
    tensors = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if (m := LAYER.search(name)) is None or int(m.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    for key, value in list(config.items()):  # per-layer lists (e.g. layer_types) keep the first layers'
        if isinstance(value, list) and len(value) == total:
            config[key] = value[:num_layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for other in model_dir.iterdir():  # tokenizer, chat template, generation config
        skip = other.suffix == ".safetensors" or other.name in ("config.json", "model.safetensors.index.json")
        if other.is_file() and not skip:
            shutil.copy(other, out_dir / other.name)
    return out_dir


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder to write the draft model to")
    ap.add_argument("--model", default="default", help="the target (a folder, hub id in the cache, or 'default')")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers to keep (the first ones)")
    args = ap.parse_args(argv)

    from vllmini.models.weight_loader import resolve_model_dir

    out = truncate(resolve_model_dir(args.model), args.layers, Path(args.out))
    print(f"wrote {out} ({args.layers} layers of {args.model})")
    return out


if __name__ == "__main__":
    main()
