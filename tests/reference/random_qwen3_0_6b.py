"""Writes a Qwen3-0.6B-shaped checkpoint with random bf16 weights (1.19 GB) for decode-speed measurements.

Usage: random_qwen3_0_6b.py OUT_DIR TOKENIZER_DIR
TOKENIZER_DIR holds Qwen3's tokenizer.json and tokenizer_config.json (`cargo xtask test`
unpacks them into target/fixtures/qwen3-tokenizer). Not used by the test suite.
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

H, L, NH, KV, D, I, V = 1024, 28, 16, 8, 128, 3072, 151936
out, tokenizer = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)


def bf16(shape, std=0.02):
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * std).to(torch.bfloat16)


def ones(n):
    return torch.ones(n, dtype=torch.bfloat16)


tensors = {"model.embed_tokens.weight": bf16((V, H)), "model.norm.weight": ones(H)}
for layer in range(L):
    p = f"model.layers.{layer}."
    tensors |= {
        p + "input_layernorm.weight": ones(H),
        p + "post_attention_layernorm.weight": ones(H),
        p + "self_attn.q_proj.weight": bf16((NH * D, H)),
        p + "self_attn.k_proj.weight": bf16((KV * D, H)),
        p + "self_attn.v_proj.weight": bf16((KV * D, H)),
        p + "self_attn.o_proj.weight": bf16((H, NH * D)),
        p + "self_attn.q_norm.weight": ones(D),
        p + "self_attn.k_norm.weight": ones(D),
        p + "mlp.gate_proj.weight": bf16((I, H)),
        p + "mlp.up_proj.weight": bf16((I, H)),
        p + "mlp.down_proj.weight": bf16((H, I)),
    }
save_file(tensors, out / "model.safetensors")
config = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
    "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": D, "vocab_size": V, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": True, "eos_token_id": 151645,
    "bos_token_id": 151643, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
}
(out / "config.json").write_text(json.dumps(config, indent=1))
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tokenizer / name, out / name)
print(out)
