#!/usr/bin/env python3
"""Write tests/fixtures/tiny-llama-gguf/: a random Llama GGUF whose weights mix every block type the
host serves, and `transformers`' logits on the same weights dequantized by the `gguf` package.

* mixed.gguf: a LlamaForCausalLM (hidden 256, intermediate 512, 2 layers, 4 heads, 2 KV heads, the
  tiny-llama fixture's 448-token vocabulary) in llama.cpp's layout (q and k rows in interleaved
  rotary order), its matrices in Q8_0, Q4_0, Q4_1, Q4_K and Q6_K, several types within each layer as
  in a Q4_K_M file. Q8_0, Q4_0 and Q4_1 come from `gguf.quants.quantize`; the package cannot quantize
  the K types, so a plain quantizer below writes their blocks (any valid blocks serve: the
  reference reads them back with the package's own dequantize).
* reference.json: three prompts of token ids and the 32 tokens `transformers` generates greedily
  after each.
* reference.safetensors: `transformers`' logits at every position of prompt plus generated tokens,
  in float16 (compact; the test's cosine bound is far above f16 rounding).

The model `transformers` runs is the GGUF dequantized with `gguf.quants.dequantize`, q and k rows
put back in Hugging Face order: an implementation independent of plughost's.

Run outside CI (needs torch, transformers, gguf, numpy):
    python tests/reference/make_gguf_fixture.py
"""

import json
import os
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from gguf_tokenizer import add_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FROM = REPO / "tests/fixtures/tiny-llama"
OUT = REPO / "tests/fixtures/tiny-llama-gguf"
Q = gguf.GGMLQuantizationType
NEW_TOKENS = 32

# (layer, leaf) -> type; every type appears, and each layer mixes several.
TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q6_K,
    (0, "attn_q"): Q.Q4_0,
    (0, "attn_k"): Q.Q4_1,
    (0, "attn_v"): Q.Q8_0,
    (0, "attn_output"): Q.Q4_K,
    (0, "ffn_gate"): Q.Q4_K,
    (0, "ffn_up"): Q.Q4_K,
    (0, "ffn_down"): Q.Q6_K,
    (1, "attn_q"): Q.Q4_K,
    (1, "attn_k"): Q.Q4_K,
    (1, "attn_v"): Q.Q6_K,
    (1, "attn_output"): Q.Q4_1,
    (1, "ffn_gate"): Q.Q4_0,
    (1, "ffn_up"): Q.Q8_0,
    (1, "ffn_down"): Q.Q4_1,
}
HF_LEAF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(x):
    """Rows of `x` (multiples of 256 long) as Q4_K blocks: x = d*sc*q - dmin*m per 32 values."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(blocks.min(axis=2), 0.0)
    step = (blocks.max(axis=2) - low) / 15.0
    d = np.maximum(step.max(axis=1), 1e-12) / 63.0
    dmin = np.maximum((-low).max(axis=1), 1e-12) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(step / d16.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    scale = d16.astype(np.float32)[:, None] * sc
    offset = dmin16.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((blocks + offset[:, :, None]) / scale[:, :, None]), 0, 15).astype(np.uint8)
    packed = np.zeros((blocks.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        packed[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        packed[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        packed[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    out = np.concatenate([f16_bytes(d16).reshape(-1, 2), f16_bytes(dmin16).reshape(-1, 2), packed, qs], axis=1)
    return out.reshape(x.shape[0], -1)


def quantize_q6_k(x):
    """Rows of `x` (multiples of 256 long) as Q6_K blocks: x = d*sc*(q - 32) per 16 values."""
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    step = np.abs(blocks).max(axis=2) / 31.0
    d = np.maximum(np.abs(step).max(axis=1), 1e-12) / 127.0
    d16 = d.astype(np.float16)
    sc = np.clip(np.round(step / d16.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    scale = d16.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(blocks / scale[:, :, None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    ql = np.zeros((q.shape[0], 2, 64), dtype=np.uint8)
    qh = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for h in range(2):
        v = q[:, h]
        ql[:, h, :32] = (v[:, 0:32] & 0xF) | ((v[:, 64:96] & 0xF) << 4)
        ql[:, h, 32:] = (v[:, 32:64] & 0xF) | ((v[:, 96:128] & 0xF) << 4)
        qh[:, h] = (v[:, 0:32] >> 4) | ((v[:, 32:64] >> 4) << 2) | ((v[:, 64:96] >> 4) << 4) | ((v[:, 96:128] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), f16_bytes(d16).reshape(-1, 2)], axis=1)
    return out.reshape(x.shape[0], -1)


def quantize(x, qtype):
    if qtype == Q.Q4_K:
        return quantize_q4_k(x)
    if qtype == Q.Q6_K:
        return quantize_q6_k(x)
    return gguf.quants.quantize(x, qtype)


def interleave_rows(rows, heads):
    """llama.cpp's permute: HF row `j * half + i` of a head becomes row `2 * i + j`."""
    n, width = rows.shape
    half = n // heads // 2
    return rows.reshape(heads, 2, half, width).swapaxes(1, 2).reshape(n, width)


def main():
    torch.manual_seed(26)
    config = LlamaConfig(
        vocab_size=448, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, initializer_range=0.08,
        bos_token_id=None, eos_token_id=447, pad_token_id=445, attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    OUT.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(OUT / "mixed.gguf"), "llama")
    writer.add_name("tiny-llama-mixed")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, TOKENIZER_FROM, config.vocab_size, config.eos_token_id, config.pad_token_id)

    dequantized = {}

    def put(gguf_name, hf_name, qtype, heads=None):
        values = state[hf_name]
        blocks = quantize(values, qtype)
        dequantized[hf_name] = gguf.quants.dequantize(blocks, qtype).reshape(values.shape)
        if heads is not None:
            blocks = interleave_rows(blocks, heads)
        writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)

    def put_f32(gguf_name, hf_name):
        dequantized[hf_name] = state[hf_name]
        writer.add_tensor(gguf_name, state[hf_name])

    put("token_embd.weight", "model.embed_tokens.weight", TYPES["token_embd"])
    put("output.weight", "lm_head.weight", TYPES["output"])
    put_f32("output_norm.weight", "model.norm.weight")
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        put_f32(f"blk.{layer}.attn_norm.weight", f"{prefix}.input_layernorm.weight")
        put_f32(f"blk.{layer}.ffn_norm.weight", f"{prefix}.post_attention_layernorm.weight")
        for leaf, hf_leaf in HF_LEAF.items():
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(leaf)
            put(f"blk.{layer}.{leaf}.weight", f"{prefix}.{hf_leaf}.weight", TYPES[(layer, leaf)], heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in dequantized.items()})
    generator = torch.Generator().manual_seed(126)
    prompts = []
    logits = {}
    for index, length in enumerate([6, 11, 17]):
        ids = torch.randint(0, 445, (1, length), generator=generator)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                next_id = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            rows = model(ids).logits[0]
        name = f"prompt{index}"
        prompts.append({"name": name, "prompt_len": length, "token_ids": ids[0].tolist()})
        logits[name] = rows.to(torch.float16).contiguous()
    safetensors.torch.save_file(logits, str(OUT / "reference.safetensors"))
    (OUT / "reference.json").write_text(json.dumps({
        "gguf": __import__("importlib.metadata").metadata.version("gguf"),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "new_tokens": NEW_TOKENS,
        "prompts": prompts,
    }, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
