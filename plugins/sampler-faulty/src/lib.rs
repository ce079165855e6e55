//! A sampler that misbehaves on request: a sequence's seed makes the call trap, loop, fail, return a token outside the vocabulary, or hoard memory.
//!
//! Every other sequence is sampled greedily after its penalties (which the host applies to
//! the row in place), so a batch's innocent rows have a known answer. The fault is chosen by
//! the input, so a fresh instance serves the next ordinary call: that is what the host's
//! culprit isolation and failure-policy tests rely on.

use plughost_sdk::sampler::{Sampled, Sampler, Sequence};

/// A sequence with this seed makes the call trap.
pub const SEED_TRAP: u64 = 66_601;
/// A sequence with this seed makes the call loop forever.
pub const SEED_LOOP: u64 = 66_602;
/// A sequence with this seed makes the call return an error.
pub const SEED_ERROR: u64 = 66_603;
/// A sequence with this seed gets a token outside the vocabulary.
pub const SEED_BAD_TOKEN: u64 = 66_604;
/// A sequence with this seed makes the instance allocate, touch and keep [`HOARD_MIB`] MiB,
/// then sample as usual.
pub const SEED_HOARD: u64 = 66_605;
/// A sequence with this seed makes the call allocate until the memory cap traps it.
pub const SEED_GROW: u64 = 66_606;

/// What [`SEED_HOARD`] keeps.
pub const HOARD_MIB: usize = 512;

#[derive(Default)]
pub struct Faulty {
    hoard: Vec<Vec<u8>>,
}

impl Sampler for Faulty {
    fn init(_config: &str) -> Result<Self, String> {
        Ok(Faulty::default())
    }

    fn sample(&mut self, batch: &[Sequence<'_>]) -> Result<Vec<Sampled>, String> {
        let mut out = Vec::with_capacity(batch.len());
        for s in batch {
            if !s.params.penalties.is_none() {
                s.logits.apply_penalties(&s.params.penalties);
            }
            let token = match s.params.seed {
                SEED_TRAP => panic!("asked to trap by request {}", s.request),
                SEED_LOOP => spin_forever(),
                SEED_ERROR => return Err(format!("asked to fail by request {}", s.request)),
                SEED_BAD_TOKEN => s.logits.len() + 7,
                SEED_HOARD => {
                    for _ in 0..HOARD_MIB {
                        self.hoard.push(vec![1u8; 1 << 20]);
                    }
                    std::hint::black_box(&self.hoard);
                    s.logits.argmax()
                }
                SEED_GROW => grow_forever(),
                _ => s.logits.argmax(),
            };
            out.push(Sampled {
                token,
                logprob: 0.0,
                top_logprobs: Vec::new(),
            });
        }
        Ok(out)
    }
}

fn spin_forever() -> ! {
    let mut counter = 0u64;
    loop {
        counter = std::hint::black_box(counter.wrapping_add(1));
    }
}

fn grow_forever() -> ! {
    let mut hoard: Vec<Vec<u8>> = Vec::new();
    loop {
        hoard.push(vec![1u8; 1 << 20]);
        std::hint::black_box(&hoard);
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_sampler!(Faulty);
