//! SmolLM2-135M-Instruct as `cargo xtask fetch-model` converts it: tokenizer and chat template against `transformers` loading the GGUF.

use plughost::model::{ChatMessage, ChatTemplate, Tokenizer};

use crate::common::smollm2;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(smollm2::model_dir()).expect("tokenizer.json loads")
}

#[test]
fn texts_encode_and_decode_as_the_reference() {
    let reference = smollm2::reference();
    let tokenizer = tokenizer();
    assert_eq!(tokenizer.vocab_size(), reference.vocab_size);
    let mut failures = Vec::new();
    for case in &reference.tokenizer {
        // The GGUF adds no BOS, so special tokens change nothing.
        for add_special_tokens in [false, true] {
            let ids = tokenizer
                .encode(&case.text, add_special_tokens)
                .expect("encode");
            if ids != case.token_ids {
                failures.push(format!(
                    "{} (add_special_tokens {add_special_tokens}): ids {ids:?}, reference {:?}",
                    case.name, case.token_ids
                ));
            }
        }
        let decodes = [(false, &case.decoded), (true, &case.decoded_skip_special)];
        for (skip_special, expected) in decodes {
            let text = tokenizer
                .decode(&case.token_ids, skip_special)
                .expect("decode");
            if &text != expected {
                failures.push(format!(
                    "{} (skip_special {skip_special}): decoded {text:?}, reference {expected:?}",
                    case.name
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn chat_template_renders_and_tokenizes_as_the_reference() {
    let reference = smollm2::reference();
    let dir = smollm2::model_dir();
    let template = ChatTemplate::from_dir(&dir).expect("chat template loads");
    let tokenizer = tokenizer();
    for case in &reference.chat {
        let messages: Vec<ChatMessage> = case
            .messages
            .iter()
            .map(|m| ChatMessage::new(&m.role, &m.content))
            .collect();
        let rendered = template
            .render(&messages, case.add_generation_prompt)
            .expect("render");
        assert_eq!(rendered, case.rendered, "{}", case.name);
        let ids = tokenizer.encode(&rendered, false).expect("encode");
        assert_eq!(ids, case.token_ids, "{}", case.name);
    }
}

#[test]
fn prompts_and_generations_round_trip() {
    let reference = smollm2::reference();
    let tokenizer = tokenizer();
    for case in &reference.generation {
        let ids = tokenizer.encode(&case.text, false).expect("encode");
        assert_eq!(ids, case.token_ids, "{}", case.name);
        let text = tokenizer
            .decode(&case.generated_token_ids, false)
            .expect("decode");
        assert_eq!(text, case.generated_text, "{}", case.name);
    }
    let answer = &reference.answer;
    assert_eq!(
        answer.generated_token_ids.last(),
        Some(&reference.eos_token_id)
    );
    let text = tokenizer
        .decode(&answer.generated_token_ids, true)
        .expect("decode");
    assert_eq!(text, answer.text);
    assert_eq!(text, "The capital of France is Paris.");
}
