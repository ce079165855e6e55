//! The chained block hash that names a full block by its tokens and everything before them.
//!
//! A block's hash covers its parent's hash, so two blocks with the same tokens
//! after different prefixes get different hashes and are never shared: the KV
//! entries of a token depend on every token before it.
//!
//! Definition (stable across runs, machines and versions, so it may be logged
//! or compared between hosts):
//!
//! ```text
//! hash(block) = SHA-256(parent || t0 || t1 || ... || t{block_size-1})
//! parent      = the previous block's hash, or 32 zero bytes for the first block
//! ti          = token id as 4 little-endian bytes
//! ```
//!
//! SHA-256 rather than a fast non-cryptographic hash because requests from
//! different users share one cache: with a collision-resistant hash nobody can
//! craft a prompt whose block collides with someone else's and read their
//! cached KV (vLLM made the same choice). The cost is one hash per full block.

use sha2::{Digest, Sha256};

/// The hash of one full block and, through the chain, of every token before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHash([u8; 32]);

impl BlockHash {
    /// The parent of a request's first block.
    const ROOT: BlockHash = BlockHash([0; 32]);

    /// Hashes the full block `tokens` that follows the block hashed as `parent`.
    pub fn new(parent: Option<&BlockHash>, tokens: &[u32]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(parent.unwrap_or(&Self::ROOT).0);
        for token in tokens {
            hasher.update(token.to_le_bytes());
        }
        BlockHash(hasher.finalize().into())
    }

    /// The 32 bytes, as a block file's header and name carry them.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A hash read back from where [`BlockHash::as_bytes`] put it.
    pub fn from_bytes(bytes: [u8; 32]) -> BlockHash {
        BlockHash(bytes)
    }
}

/// Hashes of the leading full blocks of `tokens`, computed lazily and in order, so a
/// lookup that stops at its first miss hashes no further.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> impl Iterator<Item = BlockHash> + '_ {
    let mut parent: Option<BlockHash> = None;
    tokens.chunks_exact(block_size).map(move |block| {
        let hash = BlockHash::new(parent.as_ref(), block);
        parent = Some(hash);
        hash
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(hash: &BlockHash) -> String {
        hash.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Known answers computed independently (Python `hashlib.sha256`), so the definition
    /// above, not just this implementation, is what is pinned.
    #[test]
    fn matches_the_documented_definition() {
        let first = BlockHash::new(None, &[1, 2, 3, 4]);
        let second = BlockHash::new(Some(&first), &[5, 6, 7, 8]);
        assert_eq!(hex(&first), FIRST_HEX);
        assert_eq!(hex(&second), SECOND_HEX);
    }

    const FIRST_HEX: &str = "d8faa8ec8c0500567ca87b56e4bb666d69cb512e638103891defea24e88cbc92";
    const SECOND_HEX: &str = "d1637bc3762f67abb1ac6b35e87c7ddaee8d04b0c3879d2d3afb2f6dc3f6a56a";

    #[test]
    fn chain_depends_on_the_prefix() {
        let a: Vec<_> = block_hashes(&[1, 2, 9, 9], 2).collect();
        let b: Vec<_> = block_hashes(&[3, 4, 9, 9], 2).collect();
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1], "same block tokens after a different prefix");
        assert_eq!(a[0], BlockHash::new(None, &[1, 2]));
        assert_eq!(a[1], BlockHash::new(Some(&a[0]), &[9, 9]));
    }

    #[test]
    fn partial_trailing_block_is_not_hashed() {
        let cases = [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2)];
        for (num_tokens, num_hashes) in cases {
            let tokens: Vec<u32> = (0..num_tokens).collect();
            assert_eq!(
                block_hashes(&tokens, 4).count(),
                num_hashes,
                "{num_tokens} tokens"
            );
        }
    }
}
