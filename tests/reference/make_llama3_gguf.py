#!/usr/bin/env python3
"""Write tests/fixtures/tiny-llama3-gguf/model.gguf: the tiny-llama3 fixture (Llama 3.1's
`llama3` rotary scaling) as llama.cpp's converter writes a Llama 3 model: float32 tensors, q and k
rows in interleaved rotary order, and no scaling metadata but a `rope_freqs` tensor holding each
frequency's divisor.

The test serves this file and compares it with tiny-llama3's `transformers` references, which
were computed from the config's `rope_parameters`: the host must recover those parameters from
the table. The table is computed below the way llama.cpp's `convert_hf_to_gguf.py` does for
`LlamaForCausalLM` (frequencies in float32, the ramp in float64).

Run outside CI (needs gguf, numpy, safetensors; no torch):
    python tests/reference/make_llama3_gguf.py
"""

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from gguf_convert import add_shape, gguf_name
from gguf_tokenizer import add_tokenizer

REPO = Path(__file__).resolve().parents[2]
FROM = REPO / "tests/fixtures/tiny-llama3"
OUT = REPO / "tests/fixtures/tiny-llama3-gguf"


def interleave_rows(rows, heads):
    """llama.cpp's permute: HF row `j * half + i` of a head becomes row `2 * i + j`."""
    n, width = rows.shape
    half = n // heads // 2
    return rows.reshape(heads, 2, half, width).swapaxes(1, 2).reshape(n, width)


def rope_divisors(config):
    rope = config["rope_parameters"]
    dim = config["head_dim"]
    theta = rope["rope_theta"]
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    freqs = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    window = rope["original_max_position_embeddings"]
    divisors = []
    for freq in freqs:
        wavelength = 2 * math.pi / float(freq)
        if wavelength < window / high:
            divisors.append(1.0)
        elif wavelength > window / low:
            divisors.append(factor)
        else:
            smooth = (window / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, dtype=np.float32)


def main():
    config = json.loads((FROM / "config.json").read_text())
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "llama3", rope
    state = load_file(str(FROM / "model.safetensors"))

    OUT.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(OUT / "model.gguf"), "llama")
    writer.add_name("tiny-llama3")
    add_shape(writer, config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    add_tokenizer(writer, FROM, config["vocab_size"], config["eos_token_id"], config["pad_token_id"])

    writer.add_tensor("rope_freqs.weight", rope_divisors(config))
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}
    for name in sorted(state):
        values = np.ascontiguousarray(state[name].astype(np.float32))
        for leaf, count in heads.items():
            if name.endswith(f"{leaf}.weight"):
                values = np.ascontiguousarray(interleave_rows(values, count))
        writer.add_tensor(gguf_name(name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {OUT / 'model.gguf'}")


if __name__ == "__main__":
    main()
