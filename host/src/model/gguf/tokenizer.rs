//! A byte-level BPE GGUF tokenizer as `tokenizer.json` and `tokenizer_config.json`, built the way
//! `transformers`' GGUF loader builds it.
//!
//! `transformers` (5.23, `integrations/gguf/gguf_tokenizer_mapping.py`) makes a `GPT2Tokenizer`
//! from `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`, adds the tokens typed CONTROL (3)
//! as special added tokens and USER_DEFINED (4) as plain added tokens, and replaces the GPT-2
//! pre-tokenizer for the `tokenizer.ggml.pre` values it knows a split regex for: Qwen's
//! `qwen2` becomes Qwen2's split (digits one by one) followed by a byte-level step without a
//! regex. SmolLM's `smollm` is not one of them, so it keeps GPT-2's byte-level split.
//! (llama.cpp, and SmolLM2's own `tokenizer.json`, also split digits one by one first; the two
//! differ only where a run of whitespace precedes a digit, e.g. "a\n\n2024". The reference ids
//! come from `transformers`, so this converter follows it. Likewise Qwen's own `tokenizer.json`
//! NFC-normalizes first, which `transformers`' loader leaves out: the two differ only on text
//! that is not in NFC.) A `tokenizer.ggml.pre` this converter has no split for is
//! refused, as a tokenizer that split differently would serve wrong ids.

use std::collections::HashMap;

use serde::Serialize;
use serde::ser::SerializeMap;
use serde_json::{Value, json};

use super::{Context, Gguf, GgufError, Result};

const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// Qwen2's pre-tokenizer split (`transformers`' `tokenization_qwen2.PRETOKENIZE_REGEX`, and
/// llama.cpp's for `qwen2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How text is cut into words before the merges apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// GPT-2's regex, inside the byte-level pre-tokenizer.
    Gpt2,
    /// A regex of its own, then the byte-level mapping without GPT-2's regex.
    Regex(&'static str),
}

impl Split {
    /// The split of a `tokenizer.ggml.pre` value, as `transformers`' loader applies it.
    fn of(pre: &str) -> Option<Split> {
        match pre {
            "default" | "gpt-2" | "smollm" => Some(Split::Gpt2),
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => {
                Some(Split::Regex(QWEN2_SPLIT))
            }
            _ => None,
        }
    }

    /// `tokenizer.json`'s `pre_tokenizer`.
    fn pre_tokenizer(self) -> Value {
        match self {
            Split::Gpt2 => json!({
                "type": "ByteLevel",
                "add_prefix_space": false,
                "trim_offsets": true,
                "use_regex": true,
            }),
            Split::Regex(pattern) => json!({
                "type": "Sequence",
                "pretokenizers": [
                    {
                        "type": "Split",
                        "pattern": {"Regex": pattern},
                        "behavior": "Isolated",
                        "invert": false,
                    },
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": false,
                        "trim_offsets": true,
                        "use_regex": false,
                    },
                ],
            }),
        }
    }
}

/// GPT-2's byte → character table: printable bytes stand for themselves, the others for
/// U+0100 onwards in byte order.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let b = byte as u32;
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let code = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    table
}

/// The tokenizer data of a GGUF, read and checked.
pub struct GgufTokenizer<'a> {
    tokens: Vec<&'a str>,
    token_types: Vec<i64>,
    merges: Vec<&'a str>,
    pre: &'a str,
    split: Split,
    add_bos: bool,
    add_eos: bool,
    bos: Option<&'a str>,
    eos: Option<&'a str>,
    unk: Option<&'a str>,
    pad: Option<&'a str>,
    chat_template: Option<&'a str>,
}

impl<'a> GgufTokenizer<'a> {
    pub fn from_gguf(gguf: &'a Gguf) -> Result<Self> {
        let model = gguf.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            unsupported!(
                "GGUF tokenizer.ggml.model {model:?} is not supported: only byte-level BPE (gpt2) is"
            );
        }
        let pre = match gguf.get("tokenizer.ggml.pre") {
            Some(_) => gguf.str("tokenizer.ggml.pre")?,
            None => "default",
        };
        let Some(split) = Split::of(pre) else {
            unsupported!(
                "GGUF tokenizer.ggml.pre {pre:?} is not supported: default, gpt-2, smollm and \
                 qwen2 (with its aliases deepseek-r1-qwen, kormo, f2llmv2 and megrez) are"
            );
        };
        let tokens = gguf.str_array("tokenizer.ggml.tokens")?;
        let token_types = match gguf.get("tokenizer.ggml.token_type") {
            Some(_) => gguf.int_array("tokenizer.ggml.token_type")?,
            None => Vec::new(),
        };
        ensure!(
            token_types.is_empty() || token_types.len() == tokens.len(),
            "GGUF has {} token types for {} tokens",
            token_types.len(),
            tokens.len()
        );
        let flag = |key: &str| -> Result<bool> { Ok(gguf.get(key).is_some() && gguf.bool(key)?) };
        let token = |key: &str| -> Result<Option<&'a str>> {
            let Some(_) = gguf.get(key) else {
                return Ok(None);
            };
            let id = gguf.usize(key)?;
            let text = tokens
                .get(id)
                .with_context(|| format!("GGUF {key} {id} is past the vocabulary"))?;
            Ok(Some(*text))
        };
        Ok(GgufTokenizer {
            merges: gguf.str_array("tokenizer.ggml.merges")?,
            pre,
            split,
            add_bos: flag("tokenizer.ggml.add_bos_token")?,
            add_eos: flag("tokenizer.ggml.add_eos_token")?,
            bos: token("tokenizer.ggml.bos_token_id")?,
            eos: token("tokenizer.ggml.eos_token_id")?,
            unk: token("tokenizer.ggml.unknown_token_id")?,
            pad: token("tokenizer.ggml.padding_token_id")?,
            chat_template: match gguf.get("tokenizer.chat_template") {
                Some(_) => Some(gguf.str("tokenizer.chat_template")?),
                None => None,
            },
            tokens,
            token_types,
        })
    }

    pub fn pre(&self) -> &str {
        self.pre
    }

    /// `tokenizer.json`, pretty-printed as `transformers` saves it.
    pub fn tokenizer_json(&self) -> Result<String> {
        let alphabet = bytes_to_unicode();
        let in_alphabet = |token: &str| token.chars().all(|c| alphabet.contains(&c));
        let vocab: Vec<String> = self
            .tokens
            .iter()
            .map(|&token| {
                if in_alphabet(token) {
                    token.to_string()
                } else {
                    token.bytes().map(|b| alphabet[usize::from(b)]).collect()
                }
            })
            .collect();
        let mut ids = HashMap::with_capacity(vocab.len());
        for (id, token) in vocab.iter().enumerate() {
            if let Some(first) = ids.insert(token.as_str(), id) {
                bail!("GGUF vocabulary has {token:?} twice (ids {first} and {id})");
            }
        }
        let merges = self
            .merges
            .iter()
            .map(|merge| {
                merge
                    .split_once(' ')
                    .with_context(|| format!("GGUF merge {merge:?} is not two tokens"))
            })
            .collect::<Result<Vec<_>>>()?;

        let typed = |wanted: i64| {
            self.token_types
                .iter()
                .enumerate()
                .filter(move |(_, t)| **t == wanted)
                .map(|(id, _)| id)
        };
        // A control token spelled outside the byte alphabet is a llama.cpp mislabel that
        // `transformers` skips.
        let mut added_tokens: Vec<AddedToken<'_>> = typed(CONTROL)
            .filter(|&id| in_alphabet(self.tokens[id]))
            .map(|id| AddedToken::new(id, self.tokens[id], true))
            .collect();
        added_tokens.extend(
            typed(USER_DEFINED)
                .filter(|&id| ids.contains_key(self.tokens[id]))
                .map(|id| AddedToken::new(id, self.tokens[id], false)),
        );

        let file = TokenizerFile {
            version: "1.0",
            truncation: None,
            padding: None,
            added_tokens,
            normalizer: None,
            pre_tokenizer: self.split.pre_tokenizer(),
            post_processor: self.post_processor(&ids),
            decoder: ByteLevel {
                kind: "ByteLevel",
                add_prefix_space: true,
                trim_offsets: true,
                use_regex: true,
            },
            model: Bpe {
                kind: "BPE",
                dropout: None,
                unk_token: None,
                continuing_subword_prefix: "",
                end_of_word_suffix: "",
                fuse_unk: false,
                byte_fallback: false,
                ignore_merges: false,
                vocab: OrderedVocab(&vocab),
                merges,
            },
        };
        serde_json::to_string_pretty(&file)
            .map_err(|e| GgufError::Malformed(format!("serializing tokenizer.json: {e}")))
    }

    /// `TemplateProcessing` as `TokenizersBackend.update_post_processor` sets it from the
    /// `add_bos_token` / `add_eos_token` flags.
    fn post_processor(&self, ids: &HashMap<&str, usize>) -> Value {
        let bos = self.bos.filter(|_| self.add_bos);
        let eos = self.eos.filter(|_| self.add_eos);
        let special =
            |token: &str, type_id: u32| json!({"SpecialToken": {"id": token, "type_id": type_id}});
        let sequence = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
        let mut single = Vec::new();
        single.extend(bos.map(|t| special(t, 0)));
        single.push(sequence("A", 0));
        single.extend(eos.map(|t| special(t, 0)));
        let mut pair = single.clone();
        pair.extend(bos.map(|t| special(t, 1)));
        pair.push(sequence("B", 1));
        pair.extend(eos.map(|t| special(t, 1)));
        let mut special_tokens = serde_json::Map::new();
        for token in bos.into_iter().chain(eos) {
            special_tokens.insert(
                token.to_string(),
                json!({"id": token, "ids": [ids.get(token)], "tokens": [token]}),
            );
        }
        json!({
            "type": "TemplateProcessing",
            "single": single,
            "pair": pair,
            "special_tokens": special_tokens,
        })
    }

    /// `tokenizer_config.json`: the special tokens, BOS/EOS flags and the chat template.
    pub fn tokenizer_config_json(&self, model_max_length: usize) -> Value {
        let mut config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "add_prefix_space": false,
            "bos_token": self.bos,
            "eos_token": self.eos,
            "unk_token": self.unk,
            "pad_token": self.pad,
            "clean_up_tokenization_spaces": false,
            "model_max_length": model_max_length,
        });
        if let Some(template) = self.chat_template {
            config["chat_template"] = json!(template);
        }
        config
    }
}

#[derive(Serialize)]
struct TokenizerFile<'a> {
    version: &'static str,
    truncation: Option<()>,
    padding: Option<()>,
    added_tokens: Vec<AddedToken<'a>>,
    normalizer: Option<()>,
    pre_tokenizer: Value,
    post_processor: Value,
    decoder: ByteLevel,
    model: Bpe<'a>,
}

#[derive(Serialize)]
struct AddedToken<'a> {
    id: usize,
    content: &'a str,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
    normalized: bool,
    special: bool,
}

impl<'a> AddedToken<'a> {
    fn new(id: usize, content: &'a str, special: bool) -> Self {
        AddedToken {
            id,
            content,
            single_word: false,
            lstrip: false,
            rstrip: false,
            normalized: false,
            special,
        }
    }
}

#[derive(Serialize)]
struct ByteLevel {
    #[serde(rename = "type")]
    kind: &'static str,
    add_prefix_space: bool,
    trim_offsets: bool,
    use_regex: bool,
}

#[derive(Serialize)]
struct Bpe<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    dropout: Option<f32>,
    unk_token: Option<&'a str>,
    continuing_subword_prefix: &'static str,
    end_of_word_suffix: &'static str,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    vocab: OrderedVocab<'a>,
    merges: Vec<(&'a str, &'a str)>,
}

/// The vocabulary as a JSON object in id order, as `tokenizers` writes it.
struct OrderedVocab<'a>(&'a [String]);

impl Serialize for OrderedVocab<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (id, token) in self.0.iter().enumerate() {
            map.serialize_entry(token, &id)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::GgufWriter;

    #[test]
    fn byte_table_is_gpt2s() {
        let table = bytes_to_unicode();
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
        assert_eq!(table[0], '\u{100}');
        assert_eq!(table[0xAD], 'Ń');
        let mut sorted = table.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }

    fn tiny(pre: &str, add_bos: bool) -> Gguf {
        let bytes = GgufWriter::default()
            .str("tokenizer.ggml.model", "gpt2")
            .str("tokenizer.ggml.pre", pre)
            .strs(
                "tokenizer.ggml.tokens",
                &[
                    "<|endoftext|>",
                    "<s>",
                    "a",
                    "b",
                    "ab",
                    "Ġ",
                    "Ġab",
                    "中",
                    "<think>",
                ],
            )
            .i32s("tokenizer.ggml.token_type", &[3, 3, 1, 1, 1, 1, 1, 1, 4])
            .strs("tokenizer.ggml.merges", &["a b", "Ġ ab"])
            .u32("tokenizer.ggml.bos_token_id", 1)
            .u32("tokenizer.ggml.eos_token_id", 0)
            .bool("tokenizer.ggml.add_bos_token", add_bos)
            .str("tokenizer.chat_template", "{{ messages }}")
            .build();
        Gguf::parse(bytes).expect("parses")
    }

    #[test]
    fn builds_a_byte_level_bpe_with_special_tokens() {
        let gguf = tiny("smollm", false);
        let tokenizer = GgufTokenizer::from_gguf(&gguf).expect("reads");
        let json: Value = serde_json::from_str(&tokenizer.tokenizer_json().unwrap()).unwrap();
        assert_eq!(json["model"]["vocab"]["Ġab"], 6);
        // "中" is not spelled in the byte alphabet; its UTF-8 bytes are.
        assert_eq!(json["model"]["vocab"]["ä¸Ń"], 7);
        assert_eq!(json["model"]["merges"], json!([["a", "b"], ["Ġ", "ab"]]));
        let added: Vec<(&str, bool)> = json["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["content"].as_str().unwrap(),
                    t["special"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            added,
            [("<|endoftext|>", true), ("<s>", true), ("<think>", false)]
        );
        assert_eq!(json["pre_tokenizer"]["type"], "ByteLevel");
        assert_eq!(
            json["post_processor"]["single"].as_array().unwrap().len(),
            1
        );

        let config = tokenizer.tokenizer_config_json(8192);
        assert_eq!(config["bos_token"], "<s>");
        assert_eq!(config["eos_token"], "<|endoftext|>");
        assert_eq!(config["add_bos_token"], false);
        assert_eq!(config["chat_template"], "{{ messages }}");
    }

    #[test]
    fn add_bos_token_puts_bos_in_the_template() {
        let gguf = tiny("default", true);
        let tokenizer = GgufTokenizer::from_gguf(&gguf).expect("reads");
        let json: Value = serde_json::from_str(&tokenizer.tokenizer_json().unwrap()).unwrap();
        let post = &json["post_processor"];
        assert_eq!(
            post["single"][0],
            json!({"SpecialToken": {"id": "<s>", "type_id": 0}})
        );
        assert_eq!(post["special_tokens"]["<s>"]["ids"], json!([1]));
    }

    #[test]
    fn pre_tokenizers_without_a_split_here_are_refused_naming_the_key() {
        for pre in ["llama-bpe", "made-up"] {
            let gguf = tiny(pre, false);
            let err = GgufTokenizer::from_gguf(&gguf).err().expect("refused");
            assert!(matches!(err, GgufError::Unsupported(_)), "{err}");
            assert!(
                err.to_string()
                    .contains(&format!("tokenizer.ggml.pre {pre:?} is not supported")),
                "{err}"
            );
        }
    }

    #[test]
    fn qwen2_splits_with_its_own_regex_before_the_byte_level_step() {
        let gguf = tiny("qwen2", false);
        let tokenizer = GgufTokenizer::from_gguf(&gguf).expect("reads");
        let json: Value = serde_json::from_str(&tokenizer.tokenizer_json().unwrap()).unwrap();
        let steps = &json["pre_tokenizer"]["pretokenizers"];
        assert_eq!(steps[0]["type"], "Split");
        assert_eq!(steps[0]["pattern"]["Regex"], QWEN2_SPLIT);
        assert_eq!(steps[0]["behavior"], "Isolated");
        assert_eq!(steps[1]["type"], "ByteLevel");
        assert_eq!(steps[1]["use_regex"], false);
    }
}
