//! The model's vocabulary as llguidance sees it: every token's bytes, the EOS tokens, and a tokenizer for the text a grammar forces.

use std::sync::Arc;

use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::model::Tokenizer;

use super::error::GrammarError;

/// A [`TokenizerEnv`] over the model's own tokenizer.
struct ModelTokenEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for ModelTokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            // Only forced text is tokenized here; a failure leaves the trie's greedy split.
            self.tokenizer.encode(text, false).unwrap_or_default()
        })
    }
}

/// Builds the token environment of a model whose logits rows have `vocab_size` entries.
///
/// Token bytes come from `tokenizer.json` (byte-level and byte-fallback vocabularies).
/// Rows wider than the tokenizer's vocabulary (padded embedding tables) get placeholder
/// special tokens no grammar allows; tokens past the rows cannot be sampled and are left out.
pub(super) fn build(
    tokenizer: &Tokenizer,
    vocab_size: u32,
    eos_token_ids: &[u32],
) -> Result<TokEnv, GrammarError> {
    let unavailable = |message: String| GrammarError::Unavailable(message);
    let text = std::fs::read(tokenizer.path())
        .map_err(|e| unavailable(format!("cannot read {}: {e}", tokenizer.path().display())))?;
    let json: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| unavailable(format!("{}: {e}", tokenizer.path().display())))?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
        .map_err(|e| unavailable(e.to_string()))?;
    let vocab = vocab_size as usize;
    words.truncate(vocab);
    while words.len() < vocab {
        let mut placeholder = format!(".<[{}]>", words.len()).into_bytes();
        placeholder[0] = TokTrie::SPECIAL_TOKEN_MARKER;
        words.push(placeholder);
    }
    let eos: Vec<u32> = eos_token_ids
        .iter()
        .copied()
        .filter(|&t| t < vocab_size)
        .collect();
    let Some(&first_eos) = eos.first() else {
        return Err(unavailable(
            "the model names no end-of-sequence token within its vocabulary".into(),
        ));
    };
    let info = TokRxInfo::new(vocab_size, first_eos);
    let mut trie = TokTrie::from(&info, &words);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(&eos);
    }
    Ok(Arc::new(ModelTokenEnv {
        trie,
        tokenizer: tokenizer.clone(),
    }))
}
