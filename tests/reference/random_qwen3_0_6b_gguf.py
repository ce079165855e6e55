#!/usr/bin/env python3
"""Write a Qwen3-0.6B-shaped GGUF with seeded random weights, for speed comparisons with
llama.cpp and ik_llama.cpp on the same file. Not used by the test suite.

Usage: random_qwen3_0_6b_gguf.py OUT.gguf TOKENIZER_DIR

The shape is Qwen3-0.6B's: hidden 1024, 28 layers, 16 heads / 8 KV heads, head_dim 128,
intermediate 3072, vocab 151,936, tied embeddings, rope theta 1e6, context 40,960, RMS eps 1e-6.
Weights are normal with std 0.02 (numpy's default_rng(0), drawn in float32 and rounded to
bfloat16), norms 1; matrices are BF16, norms F32, as llama.cpp's `convert_hf_to_gguf.py
--outtype bf16` writes a Qwen3 checkpoint (see qwen3_gguf.py). The file is about 1.2 GB (0.6B
parameters in BF16; the embedding, tied, is also the output projection). TOKENIZER_DIR holds
Qwen3's tokenizer.json and tokenizer_config.json (`cargo xtask test` unpacks them into
target/fixtures/qwen3-tokenizer). Needs gguf, numpy; no torch. Takes about a minute.

The quantized files and the servers, run by hand (QM=target/models/qwen3-0.6b-shape):
    python3 tests/reference/random_qwen3_0_6b_gguf.py $QM.BF16.gguf target/fixtures/qwen3-tokenizer
    /work/peers/llama-build/bin/llama-quantize $QM.BF16.gguf $QM.Q8_0.gguf Q8_0
    /work/peers/llama-build/bin/llama-quantize $QM.BF16.gguf $QM.Q4_K_M.gguf Q4_K_M
    /work/peers/llama-build/bin/llama-server -m $QM.Q8_0.gguf -t 2 -np 1 --port 8081
    /work/peers/ik-build/bin/llama-server -m $QM.Q8_0.gguf -t 2 -np 1 -rtr --port 8082
    plughost serve --model $QM.Q8_0.gguf --port 8000
(the peers' paths are this machine's; `cargo xtask compare` takes its own). llama-quantize's
Q4_K_M keeps some tensors at Q6_K (the tied embedding and half the attn_v / ffn_down rows),
which plughost reads too.
"""

import sys
from pathlib import Path

import numpy as np

from qwen3_gguf import write_qwen3_gguf

H, L, NH, KV, D, I, V = 1024, 28, 16, 8, 128, 3072, 151936
CONFIG = {
    "hidden_size": H,
    "num_hidden_layers": L,
    "num_attention_heads": NH,
    "num_key_value_heads": KV,
    "head_dim": D,
    "intermediate_size": I,
    "vocab_size": V,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def tensors(rng):
    """HF name -> float32 values, drawn lazily in a fixed order (the seed decides every value)."""

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    yield "model.embed_tokens.weight", normal(V, H)
    for layer in range(L):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", ones(H)
        yield p + "self_attn.q_proj.weight", normal(NH * D, H)
        yield p + "self_attn.k_proj.weight", normal(KV * D, H)
        yield p + "self_attn.v_proj.weight", normal(KV * D, H)
        yield p + "self_attn.o_proj.weight", normal(H, NH * D)
        yield p + "self_attn.q_norm.weight", ones(D)
        yield p + "self_attn.k_norm.weight", ones(D)
        yield p + "post_attention_layernorm.weight", ones(H)
        yield p + "mlp.gate_proj.weight", normal(I, H)
        yield p + "mlp.up_proj.weight", normal(I, H)
        yield p + "mlp.down_proj.weight", normal(H, I)
    yield "model.norm.weight", ones(H)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, tokenizer_dir = Path(sys.argv[1]), Path(sys.argv[2])
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_qwen3_gguf(out, "qwen3-0.6b-shape", CONFIG, tensors(rng), tokenizer_dir, "BF16")
    print(out)


if __name__ == "__main__":
    main()
