//! The engine's token logprobs in the two OpenAI shapes: legacy completions lists and chat's per-token records.

use crate::engine::TokenLogprob;
use crate::model::Tokenizer;

use super::openai::{
    ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, TopLogprobMap,
};

/// A token's text as clients see it, and its exact bytes.
///
/// The text is the token decoded alone. A token holding part of a UTF-8 character decodes to
/// U+FFFD; its bytes then come from the vocabulary entry (byte-level BPE pieces, or
/// SentencePiece `<0xAB>` byte tokens), so that concatenated `bytes` rebuild the output.
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let text = tokenizer
        .decode(&[id], false)
        .ok()
        .or_else(|| tokenizer.id_to_token(id))
        .unwrap_or_default();
    if !text.contains('\u{FFFD}') {
        let bytes = text.as_bytes().to_vec();
        return (text, bytes);
    }
    let bytes = tokenizer
        .id_to_token(id)
        .and_then(|piece| raw_bytes(&piece))
        .unwrap_or_else(|| text.as_bytes().to_vec());
    (text, bytes)
}

/// The bytes behind a vocabulary piece that is a byte token or written in GPT-2's byte alphabet.
fn raw_bytes(piece: &str) -> Option<Vec<u8>> {
    if let Some(hex) = piece.strip_prefix("<0x").and_then(|p| p.strip_suffix('>')) {
        return u8::from_str_radix(hex, 16).ok().map(|b| vec![b]);
    }
    piece.chars().map(byte_level_byte).collect()
}

/// Inverse of GPT-2's byte-to-character table: printable bytes stand for themselves, the
/// others were moved to U+0100 onwards in byte order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let code = c as u32;
    if code < 256 && printable(code as u8) {
        return Some(code as u8);
    }
    let offset = code.checked_sub(256)? as usize;
    (0..=255u8).filter(|b| !printable(*b)).nth(offset)
}

/// JSON has no infinities; vLLM reports an impossible token as -9999.
pub(super) fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// Completions logprobs for a run of tokens whose text starts at `text_offset` (in characters);
/// advances the offset past them. Each `top_logprobs` entry holds the `num_top` most likely
/// tokens and the chosen one.
pub fn completion_logprobs(
    tokenizer: &Tokenizer,
    logprobs: &[TokenLogprob],
    num_top: u32,
    text_offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in logprobs {
        let (token, _) = token_text(tokenizer, lp.token);
        let mut top: Vec<(String, f32)> = lp
            .top
            .iter()
            .take(num_top as usize)
            .map(|c| (token_text(tokenizer, c.id).0, finite(c.value)))
            .collect();
        if !lp
            .top
            .iter()
            .take(num_top as usize)
            .any(|c| c.id == lp.token)
        {
            top.push((token.clone(), finite(lp.logprob)));
        }
        out.text_offset.push(*text_offset);
        *text_offset += token.chars().count();
        out.tokens.push(token);
        out.token_logprobs.push(Some(finite(lp.logprob)));
        out.top_logprobs.push(Some(TopLogprobMap(top)));
    }
    out
}

pub fn chat_logprobs(
    tokenizer: &Tokenizer,
    logprobs: &[TokenLogprob],
    num_top: u32,
) -> ChatLogprobs {
    let content = logprobs
        .iter()
        .map(|lp| {
            let (token, bytes) = token_text(tokenizer, lp.token);
            let top_logprobs = lp
                .top
                .iter()
                .take(num_top as usize)
                .map(|c| {
                    let (token, bytes) = token_text(tokenizer, c.id);
                    ChatTopLogprob {
                        token,
                        logprob: finite(c.value),
                        bytes,
                    }
                })
                .collect();
            ChatTokenLogprob {
                token,
                logprob: finite(lp.logprob),
                bytes,
                top_logprobs,
            }
        })
        .collect();
    ChatLogprobs {
        content,
        refusal: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_characters_map_back_to_bytes() {
        assert_eq!(byte_level_byte('a'), Some(b'a'));
        assert_eq!(byte_level_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_byte('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_byte('Ã'), Some(0xC3));
        assert_eq!(byte_level_byte('世'), None);
        assert_eq!(raw_bytes("<0xE4>"), Some(vec![0xE4]));
        assert_eq!(raw_bytes("ĠÃ"), Some(vec![b' ', 0xC3]));
    }
}
