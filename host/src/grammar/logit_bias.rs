//! A request's `logit_bias`: offsets added to chosen tokens' logits before the grammar mask and the sampler.

/// OpenAI's bound on each offset, either way.
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Token ids and the offset each gets, sorted by id, each id once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBias(Vec<(u32, f32)>);

impl LogitBias {
    /// Takes `(token, offset)` pairs already checked against the vocabulary and the range;
    /// a token named twice keeps its last offset.
    pub fn new(mut entries: Vec<(u32, f32)>) -> LogitBias {
        entries.reverse();
        entries.sort_by_key(|&(token, _)| token);
        entries.dedup_by_key(|&mut (token, _)| token);
        LogitBias(entries)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds each offset to its token's logit; ids past the row are skipped.
    pub fn apply(&self, row: &mut [f32]) {
        for &(token, offset) in &self.0 {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit += offset;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_add_once_per_token_the_last_one_wins() {
        let bias = LogitBias::new(vec![(2, 5.0), (0, -1.0), (2, 7.0), (9, 1.0)]);
        let mut row = [1.0, 1.0, 1.0];
        bias.apply(&mut row);
        assert_eq!(row, [0.0, 1.0, 8.0]);
    }
}
