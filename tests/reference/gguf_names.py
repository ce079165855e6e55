"""Hugging Face tensor names as llama.cpp's converter names them in a GGUF (Llama and Qwen3
layers). Shared by the scripts that write GGUF fixtures."""

LEAVES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}

FIXED = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name):
    if hf_name in FIXED:
        return FIXED[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LEAVES[rest.removesuffix('.weight')]}.weight"
