#!/usr/bin/env python3
"""Write tests/fixtures/tiny-qwen3-gguf/model.gguf and tests/fixtures/tiny-qwen3-bf16-gguf/model.gguf:
the tiny-qwen3 fixture (float32) and tiny-qwen3-bf16 (its weights rounded to bfloat16; the norms
widened to float32, as llama.cpp's converter stores every 1-D tensor) as `convert_hf_to_gguf.py`
writes a `Qwen3ForCausalLM` checkpoint (see qwen3_gguf.py).

The tests serve these files and hold them to tiny-qwen3's and tiny-qwen3-bf16's `transformers`
references, and check that the tokenizer the host builds from the metadata encodes like the
fixture's own tokenizer.json.

Run outside CI (needs gguf, numpy, safetensors; no torch):
    python tests/reference/make_qwen3_gguf.py
"""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from qwen3_gguf import to_bf16_bits, write_qwen3_gguf

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests/fixtures"


def raw_bf16_tensors(path):
    """A bfloat16 safetensors file's tensors as uint16 bits (numpy has no bfloat16)."""
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    body = data[8 + header_len:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "BF16", (name, entry["dtype"])
        start, end = entry["data_offsets"]
        out[name] = np.frombuffer(body[start:end], dtype=np.uint16).reshape(entry["shape"])
    return out


def main():
    source = FIXTURES / "tiny-qwen3"
    config = json.loads((source / "config.json").read_text())
    state = load_file(str(source / "model.safetensors"))
    # tiny-qwen3-bf16 is tiny-qwen3 rounded; converting it keeps its matrices' bits and widens
    # its norms to float32 exactly.
    stored = raw_bf16_tensors(FIXTURES / "tiny-qwen3-bf16/model.safetensors")
    assert sorted(stored) == sorted(state)
    for name, bits in stored.items():
        assert np.array_equal(to_bf16_bits(state[name]), bits), name
    widened = {name: (bits.astype(np.uint32) << 16).view(np.float32) for name, bits in stored.items()}

    for out_name, weights, file_type in (
        ("tiny-qwen3-gguf", state, "F32"),
        ("tiny-qwen3-bf16-gguf", widened, "BF16"),
    ):
        out = FIXTURES / out_name
        out.mkdir(parents=True, exist_ok=True)
        tensors = [(name, weights[name]) for name in sorted(weights)]
        write_qwen3_gguf(out / "model.gguf", out_name, config, tensors, source, file_type)
        print(f"wrote {out / 'model.gguf'}")


if __name__ == "__main__":
    main()
