"""The tiny fixtures' byte-level BPE tokenizer written into a GGUF's metadata, as llama.cpp's
converter writes a `gpt2`-model tokenizer. Shared by the scripts that write GGUF fixtures."""

import json


def add_tokenizer(writer, tokenizer_dir, vocab_size, eos_token_id, pad_token_id):
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokens = [""] * vocab_size
    for text, index in tok["model"]["vocab"].items():
        tokens[index] = text
    types = [1] * vocab_size
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(eos_token_id)
    writer.add_pad_token_id(pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok_config["chat_template"])
