//! The tokenizer of a model folder (`tokenizer.json`), and incremental detokenizing for streams.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::error::ModelError;

const TOKENIZER_FILE: &str = "tokenizer.json";

/// The smallest prefix [`Tokenizer::encode_within`] probes; shorter texts are tokenized whole.
const MIN_PROBE_BYTES: usize = 4 << 10;
/// Bytes per token of ordinary text in the usual vocabularies, to size the first probe so that
/// it is the last one for a prompt that is too long.
const PROBE_BYTES_PER_TOKEN: usize = 4;
/// How many more tokens than the bound a prefix must have to condemn the whole text.
const PROBE_MARGIN_TOKENS: usize = 64;

/// What [`Tokenizer::encode_within`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bounded {
    Tokens(Vec<u32>),
    /// The text's first `prefix_bytes` bytes alone are `prefix_tokens` tokens.
    TooLong {
        prefix_bytes: usize,
        prefix_tokens: usize,
    },
}

/// A loaded `tokenizer.json`. Cloning is cheap: clones share the same tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    path: Arc<PathBuf>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a model folder.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, ModelError> {
        Self::from_file(dir.as_ref().join(TOKENIZER_FILE))
    }

    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref().to_path_buf();
        if !path.is_file() {
            return Err(ModelError::Io {
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
                path,
            });
        }
        let inner =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::TokenizerLoad {
                message: e.to_string(),
                path: path.clone(),
            })?;
        Ok(Tokenizer {
            inner: Arc::new(inner),
            path: Arc::new(path),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) always map to
    /// their ids; `add_special_tokens` adds the post-processor's tokens (a BOS, for example).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.error("encode", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of `text`, or [`Bounded::TooLong`] once a prefix of it shows that it has far
    /// more than `max_tokens`. Tokenizing holds over a hundred bytes of memory per byte of
    /// text, so a prompt of megabytes that cannot fit the context is refused from a prefix
    /// instead: the first probe is about as long as `max_tokens` tokens of ordinary text, and
    /// each further one twice the one before.
    pub fn encode_within(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_tokens: usize,
    ) -> Result<Bounded, ModelError> {
        let bound = max_tokens.saturating_add(PROBE_MARGIN_TOKENS);
        let mut probe = bound
            .saturating_mul(PROBE_BYTES_PER_TOKEN)
            .max(MIN_PROBE_BYTES);
        while probe < text.len() {
            let prefix = &text[..text.floor_char_boundary(probe)];
            let prefix_tokens = self.encode(prefix, add_special_tokens)?.len();
            // The rest of the text can only re-merge the prefix's last word, which costs a few
            // tokens, never the margin.
            if prefix_tokens > bound {
                return Ok(Bounded::TooLong {
                    prefix_bytes: prefix.len(),
                    prefix_tokens,
                });
            }
            probe = probe.saturating_mul(2);
        }
        self.encode(text, add_special_tokens).map(Bounded::Tokens)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.error("decode", e))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A detokenizer for one output stream.
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream {
        DecodeStream {
            tokenizer: self.clone(),
            skip_special_tokens,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    fn error(&self, operation: &'static str, e: tokenizers::Error) -> ModelError {
        ModelError::Tokenize {
            path: self.path.to_path_buf(),
            operation,
            message: e.to_string(),
        }
    }
}

/// Turns a stream of token ids into text deltas that never split a UTF-8 character.
///
/// A token's text depends on its neighbours (byte-level BPE splits characters across tokens;
/// SentencePiece drops the leading space of the first token), so each step decodes a small
/// window of recent tokens and emits what the window adds beyond its already-emitted prefix.
/// A decode ending in U+FFFD means a character is still incomplete: nothing is emitted until a
/// later token completes it. The deltas, followed by [`DecodeStream::flush`], concatenate to
/// `decode(all ids)`.
#[derive(Debug, Clone)]
pub struct DecodeStream {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// The window: tokens from the start of the emitted prefix onwards.
    ids: Vec<u32>,
    /// `decode(ids[..prefix_index])`, already emitted.
    prefix: String,
    prefix_index: usize,
}

impl DecodeStream {
    /// Adds one token; returns the text it completes, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, ModelError> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let delta = self.delta(&text)?;
        let consumed = self.prefix_index;
        self.ids.drain(..consumed);
        self.prefix = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        self.prefix_index = self.ids.len();
        Ok(Some(delta))
    }

    /// Emits whatever is still held back (an incomplete character at the end of the stream
    /// becomes U+FFFD, as in a full decode) and starts afresh.
    pub fn flush(&mut self) -> Result<Option<String>, ModelError> {
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let delta = if text.len() > self.prefix.len() {
            Some(self.delta(&text)?)
        } else {
            None
        };
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        Ok(delta)
    }

    fn delta(&self, text: &str) -> Result<String, ModelError> {
        match text.strip_prefix(self.prefix.as_str()) {
            Some(delta) => Ok(delta.to_string()),
            None => Err(ModelError::Tokenize {
                path: self.tokenizer.path().to_path_buf(),
                operation: "decode incrementally",
                message: format!(
                    "decoding {:?} no longer starts with the emitted text {:?}",
                    self.ids, self.prefix
                ),
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// GPT-2's byte-to-character table that byte-level BPE vocabularies are written in.
    fn byte_char(byte: u8) -> char {
        let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        if printable(byte) {
            return char::from(byte);
        }
        let offset = (0..byte).filter(|b| !printable(*b)).count() as u32;
        char::from_u32(256 + offset).unwrap_or('?')
    }

    fn byte_level(text: &str) -> String {
        text.bytes().map(byte_char).collect()
    }

    /// A byte-level BPE tokenizer whose vocabulary is the 256 bytes plus merges that end in
    /// the middle of multi-byte characters, and one special token, written to a fresh folder.
    pub(crate) fn byte_level_tokenizer(name: &str) -> PathBuf {
        let mut vocab = serde_json::Map::new();
        for byte in 0..=255u8 {
            vocab.insert(byte_char(byte).to_string(), serde_json::json!(byte));
        }
        let emoji = "😀".as_bytes();
        let han = "世".as_bytes();
        let pieces = [
            (&emoji[..1], &emoji[1..2]),
            (&han[1..2], &han[2..3]),
            (b"H", b"e"),
        ];
        let mut merges = Vec::new();
        for (left, right) in pieces {
            let (left, right) = (byte_level_bytes(left), byte_level_bytes(right));
            vocab.insert(format!("{left}{right}"), serde_json::json!(vocab.len()));
            merges.push(format!("{left} {right}"));
        }
        let special_id = vocab.len();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [{
                "id": special_id, "content": "<|end|>", "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }],
            "normalizer": null,
            "pre_tokenizer": {
                "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                "use_regex": true
            },
            "post_processor": null,
            "decoder": {
                "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                "use_regex": true
            },
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges
            }
        });
        let dir =
            std::env::temp_dir().join(format!("plughost-model-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create test folder");
        std::fs::write(dir.join(TOKENIZER_FILE), json.to_string()).expect("write tokenizer");
        dir
    }

    fn byte_level_bytes(bytes: &[u8]) -> String {
        bytes.iter().copied().map(byte_char).collect()
    }

    /// Streams `ids` one at a time and checks every delta is clean text.
    pub(crate) fn stream_text(tokenizer: &Tokenizer, ids: &[u32], skip_special: bool) -> String {
        let mut stream = tokenizer.decode_stream(skip_special);
        let mut out = String::new();
        for &id in ids {
            if let Some(delta) = stream.step(id).expect("step") {
                assert!(
                    !delta.contains('\u{FFFD}'),
                    "delta {delta:?} splits a character"
                );
                out.push_str(&delta);
            }
        }
        if let Some(rest) = stream.flush().expect("flush") {
            out.push_str(&rest);
        }
        out
    }

    #[test]
    fn streamed_text_concatenates_to_the_full_decode() {
        let dir = byte_level_tokenizer("stream");
        let tokenizer = Tokenizer::from_dir(&dir).expect("load");
        let texts = [
            "Hello, world!",
            "你好，世界 😀😀 done",
            "😀",
            "mixed: Héllo 世界<|end|> after the end 🎉",
            "",
        ];
        for text in texts {
            let ids = tokenizer.encode(text, false).expect("encode");
            assert_eq!(tokenizer.decode(&ids, false).expect("decode"), text);
            for skip in [false, true] {
                let full = tokenizer.decode(&ids, skip).expect("decode");
                assert_eq!(
                    stream_text(&tokenizer, &ids, skip),
                    full,
                    "{text:?} skip={skip}"
                );
            }
        }
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn an_incomplete_character_is_held_back_until_completed() {
        let dir = byte_level_tokenizer("holdback");
        let tokenizer = Tokenizer::from_dir(&dir).expect("load");
        let ids = tokenizer.encode("a😀", false).expect("encode");
        // "a", then the emoji's four bytes as the merged first two and two single bytes.
        assert_eq!(ids.len(), 4, "{ids:?}");
        let mut stream = tokenizer.decode_stream(false);
        let deltas: Vec<Option<String>> = ids
            .iter()
            .map(|&id| stream.step(id).expect("step"))
            .collect();
        assert_eq!(deltas, [Some("a".into()), None, None, Some("😀".into())]);

        // A stream cut inside a character flushes what a full decode shows.
        let mut stream = tokenizer.decode_stream(false);
        for &id in &ids[..3] {
            stream.step(id).expect("step");
        }
        let full = tokenizer.decode(&ids[..3], false).expect("decode");
        assert_eq!(
            format!("a{}", stream.flush().expect("flush").unwrap_or_default()),
            full
        );
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn vocabulary_lookups_and_missing_files() {
        let dir = byte_level_tokenizer("vocab");
        let tokenizer = Tokenizer::from_dir(&dir).expect("load");
        assert_eq!(tokenizer.vocab_size(), 256 + 3 + 1);
        let end = tokenizer.token_to_id("<|end|>").expect("special token");
        assert_eq!(tokenizer.id_to_token(end).as_deref(), Some("<|end|>"));
        assert_eq!(tokenizer.token_to_id(&byte_level("He")), Some(258));
        assert_eq!(tokenizer.encode("<|end|>", false).expect("encode"), [end]);

        let missing = Tokenizer::from_dir(dir.join("nowhere"))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("nowhere/tokenizer.json"), "{missing}");
        std::fs::write(dir.join(TOKENIZER_FILE), "{ not json").expect("write");
        let broken = Tokenizer::from_dir(&dir).unwrap_err().to_string();
        assert!(broken.contains("tokenizer.json"), "{broken}");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn a_text_far_beyond_the_bound_is_refused_from_a_prefix() {
        let dir = byte_level_tokenizer("bounded");
        let tokenizer = Tokenizer::from_dir(&dir).expect("load");
        // One token per byte in this vocabulary, "He" aside.
        let short = "Hello world. ".repeat(100);
        let long = "Hello world. ".repeat(10_000);
        let cases = [
            (short.as_str(), 2000, true),
            (short.as_str(), 10, true), // under the smallest probe: tokenized whole
            (long.as_str(), 200_000, true),
            (long.as_str(), 1000, false),
            (long.as_str(), 5000, false),
        ];
        for (text, bound, tokenized) in cases {
            let result = tokenizer.encode_within(text, false, bound).expect("encode");
            match result {
                Bounded::Tokens(tokens) => {
                    assert!(tokenized, "{} bytes under {bound}", text.len());
                    assert_eq!(tokens, tokenizer.encode(text, false).expect("encode"));
                }
                Bounded::TooLong {
                    prefix_bytes,
                    prefix_tokens,
                } => {
                    assert!(!tokenized, "{} bytes under {bound}", text.len());
                    assert!(prefix_bytes < text.len() / 2, "{prefix_bytes} bytes probed");
                    let prefix = &text[..prefix_bytes];
                    assert_eq!(
                        prefix_tokens,
                        tokenizer.encode(prefix, false).expect("encode").len()
                    );
                    assert!(prefix_tokens > bound);
                }
            }
        }
        std::fs::remove_dir_all(dir).ok();
    }
}
