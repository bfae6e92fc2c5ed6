//! Loss reduction expressed as per-token weights on a mini-batch of B sequences.
//!
//! The worker sums `loss_t · w_t`; these weights turn that sum into the chosen mean, so the
//! mini-batch loss is the same however it is split into micro-batches or data-parallel ranks.
//! Weight of a valid token (mask ≠ 0) of sequence i; masked tokens get 0:
//!
//! | mode | weight |
//! |---|---|
//! | `token_mean` (default) | `1 / max(Σ_all m, 1)` |
//! | `sequence_mean` | `1 / (B · max(Σ_t m_i, 1))` |
//! | `seq_mean_token_sum_norm` | `1 / (B · max_seq_len)` (`max_seq_len` required) |
//! | `prompt_mean` | `1 / (P · max(Σ m over the prompt's group, 1))`, P = groups in the mini-batch |

use std::collections::HashMap;
use std::hash::Hash;

use super::rows::{check_group_count, group_members, is_valid};
use crate::{Error, Result};

crate::choice! {
    /// Which loss reduction (what a run config names; [`LossReduction::of`] builds it).
    pub enum ReductionKind("loss reduction") {
        TokenMean = "token_mean",
        SequenceMean = "sequence_mean",
        /// Needs `max_seq_len`.
        SeqMeanTokenSumNorm = "seq_mean_token_sum_norm",
        PromptMean = "prompt_mean",
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReduction {
    TokenMean,
    SequenceMean,
    SeqMeanTokenSumNorm { max_seq_len: usize },
    PromptMean,
}

impl LossReduction {
    /// The mode `name`; `max_seq_len` is required by (and only used for) `seq_mean_token_sum_norm`.
    pub fn from_name(name: &str, max_seq_len: Option<usize>) -> Result<Self> {
        Self::of(ReductionKind::from_name(name).map_err(Error::input)?, max_seq_len)
    }

    /// The mode `kind` (`max_seq_len` as in [`LossReduction::from_name`]).
    pub fn of(kind: ReductionKind, max_seq_len: Option<usize>) -> Result<Self> {
        match kind {
            ReductionKind::TokenMean => Ok(Self::TokenMean),
            ReductionKind::SequenceMean => Ok(Self::SequenceMean),
            ReductionKind::PromptMean => Ok(Self::PromptMean),
            ReductionKind::SeqMeanTokenSumNorm => match max_seq_len {
                Some(n) if n > 0 => Ok(Self::SeqMeanTokenSumNorm { max_seq_len: n }),
                _ => Err(Error::input("loss reduction `seq_mean_token_sum_norm` needs max_seq_len > 0")),
            },
        }
    }
}

/// Per-token weights for `mask` (one row per sequence); `groups` holds one id per sequence
/// (only `prompt_mean` reads it, but its length is always checked).
pub fn loss_reduction_weights<G: Eq + Hash>(
    reduction: LossReduction,
    mask: &[Vec<f32>],
    groups: &[G],
) -> Result<Vec<Vec<f32>>> {
    check_group_count(mask.len(), groups)?;
    let b = mask.len() as f64;
    let valid_count = |row: &Vec<f32>| row.iter().filter(|&&m| is_valid(m)).count() as f64;
    let per_sequence: Vec<f64> = match reduction {
        LossReduction::TokenMean => {
            let total: f64 = mask.iter().map(valid_count).sum();
            vec![1.0 / total.max(1.0); mask.len()]
        }
        LossReduction::SequenceMean => mask.iter().map(|row| 1.0 / (b * valid_count(row).max(1.0))).collect(),
        LossReduction::SeqMeanTokenSumNorm { max_seq_len } => vec![1.0 / (b * max_seq_len as f64); mask.len()],
        LossReduction::PromptMean => {
            let members = group_members(groups);
            let p = members.len() as f64;
            let mut weight_of: HashMap<usize, f64> = HashMap::new();
            for group in &members {
                let group_tokens: f64 = group.iter().map(|&i| valid_count(&mask[i])).sum();
                for &i in group {
                    weight_of.insert(i, 1.0 / (p * group_tokens.max(1.0)));
                }
            }
            (0..mask.len()).map(|i| weight_of[&i]).collect()
        }
    };
    Ok(mask
        .iter()
        .zip(per_sequence)
        .map(|(row, w)| row.iter().map(|&m| if is_valid(m) { w as f32 } else { 0.0 }).collect())
        .collect())
}
