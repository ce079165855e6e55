"""A Qwen3 model written as a GGUF the way llama.cpp's `convert_hf_to_gguf.py` writes a
`Qwen3ForCausalLM` checkpoint (`conversion/qwen.py`'s `Qwen3Model`, `base.py`'s
`TextModel.set_gguf_parameters`, `get_vocab_base` and `_set_vocab_gpt2`), without torch or
`transformers`: metadata under `qwen3.*`, the `gpt2` tokenizer model with the `qwen2`
pre-tokenizer, `attn_q_norm` / `attn_k_norm` per layer, q and k rows in Hugging Face's order
(llama.cpp rotates Qwen3 NEOX-style, so unlike Llama nothing is permuted), no `output.weight`
when the embeddings are tied, and 1-D tensors (the norms) kept in float32 whatever the file type.

Shared by `make_qwen3_gguf.py` (the tiny fixtures) and `random_qwen3_0_6b_gguf.py`.
"""

import json
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np

from gguf_convert import add_shape, gguf_name

# llama.cpp's file types (`gguf.LlamaFileType`) for the two this module writes.
FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16}


def to_bf16_bits(values):
    """float32 -> bfloat16 bits (uint16), rounding to nearest even, as torch and gguf do."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


def looks_special(token):
    """`TextModel.does_token_look_special`."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def vocab_tokens(tokenizer_json, vocab_size):
    """`get_vocab_base`: the token list padded to `vocab_size` with `[PAD{i}]` (UNUSED), and
    each token's type: added tokens CONTROL when special or special-looking, else
    USER_DEFINED; the rest NORMAL."""
    by_id = {index: text for text, index in tokenizer_json["model"]["vocab"].items()}
    added = {token["id"]: token for token in tokenizer_json["added_tokens"]}
    for index, token in added.items():
        by_id[index] = token["content"]
    assert max(by_id) < vocab_size, (max(by_id), vocab_size)
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            token = by_id[index]
            if added[index]["special"] or looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def add_vocab(writer, tokenizer_dir, config):
    """`_set_vocab_gpt2` with the `qwen2` pre-tokenizer (what llama.cpp's hash of a Qwen
    tokenizer's output picks), then `SpecialVocab` over the tokenizer files and the model's
    config (its `bos_token_id` stands in for the tokenizer's null `bos_token`)."""
    tokenizer_json = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tokens, types = vocab_tokens(tokenizer_json, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, scratch / name)
        ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config}
        (scratch / "config.json").write_text(json.dumps(ids))
        special = gguf.SpecialVocab(scratch, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(writer)


def write_qwen3_gguf(path, name, config, tensors, tokenizer_dir, file_type):
    """Writes `tensors` (HF name -> float32 array, in the order given) as a Qwen3 GGUF at
    `path`; `file_type` "F32" or "BF16" (matrices only: 1-D tensors stay float32)."""
    rope = config.get("rope_parameters") or {"rope_theta": config["rope_theta"]}
    assert rope.get("rope_type", "default") == "default", rope
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    add_shape(writer, config)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(FILE_TYPES[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(writer, tokenizer_dir, config)

    for hf_name, values in tensors:
        if config["tie_word_embeddings"] and hf_name == "lm_head.weight":
            continue
        values = np.ascontiguousarray(values, dtype=np.float32)
        if file_type == "BF16" and values.ndim > 1:
            writer.add_tensor(gguf_name(hf_name), to_bf16_bits(values), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(gguf_name(hf_name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
