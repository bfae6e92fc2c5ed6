//! One RL step's numbers: from finished episodes and the forward passes over them to the datums
//! of every mini-batch (docs/specs/algorithms.md, every formula from `algo`).
//!
//! ```text
//! per episode, over its sampled positions only (mask m; prompt and tool tokens excluded):
//!     token rewards  r_t = 0 …, the episode's reward at its last sampled token
//!                    r_t −= kl_coef · k(old_t, ref_t)        (KL in the reward, if chosen)
//!     advantages, returns = estimator(r, values, m, groups)  (grpo, rloo, reinforce++, gae)
//!     off-policy: mask, is_weight = correction(old, roll, m)  (if configured)
//! per mini-batch (whole groups, in order):
//!     w_t = reduction weight (token_mean, sequence_mean, …) · is_weight_t
//!     datum = {input, target, weights w, logprobs old, advantages, rollout_logprobs roll,
//!              ref_logprobs (KL in the loss)}; critic datum = {weights w, values, returns}
//! ```
//! `old` is the policy's log-prob recomputed at the start of the step (before any update, so
//! every epoch and mini-batch of the step anchors its ratio on the same policy); `roll` is the
//! sampler's. The arrays are computed on the compacted sampled positions of each episode and
//! scattered back to its full-length rows, so multi-turn episodes are handled like single-turn
//! ones. KL metrics use the estimator on (old, ref); `entropy_mean` is the Monte-Carlo estimate
//! `mean(−log p(sampled token))` under the sampler (exact in expectation at temperature 1).

use crate::algo::{AdvantageEstimator, KlEstimator, LossReduction, Metrics, OffPolicyCorrection};
use crate::trainer::rl::episodes::Episode;
use crate::worker::{Datum, LossFnInputs};
use crate::{Error, Result};

/// How the step turns episodes into datums (parsed from the RL config once).
#[derive(Clone, Debug)]
pub struct StepRecipe {
    pub advantage: AdvantageEstimator,
    pub reduction: LossReduction,
    /// KL coefficient and estimator; `in_reward` subtracts it from the token rewards, otherwise
    /// the policy loss carries it (then `ref_logprobs` go into the datums).
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    pub kl_in_reward: bool,
    pub off_policy: Option<OffPolicyCorrection>,
}

/// Everything per episode, full-length rows (one entry per position of the datum).
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedEpisodes {
    pub mask: Vec<Vec<f32>>,
    pub old: Vec<Vec<f32>>,
    pub roll: Vec<Vec<f32>>,
    pub reference: Option<Vec<Vec<f32>>>,
    pub values: Option<Vec<Vec<f32>>>,
    pub token_rewards: Vec<Vec<f32>>,
    pub advantages: Vec<Vec<f32>>,
    pub returns: Vec<Vec<f32>>,
    pub is_weights: Vec<Vec<f32>>,
    /// `kl:mean` (over sampled tokens, when a reference exists), off-policy metrics.
    pub metrics: Metrics,
}

fn positions(mask: &[f32]) -> Vec<usize> {
    mask.iter().enumerate().filter(|(_, &m)| m != 0.0).map(|(t, _)| t).collect()
}

fn compact(row: &[f32], at: &[usize]) -> Vec<f32> {
    at.iter().map(|&t| row[t]).collect()
}

fn scatter(values: &[f32], at: &[usize], len: usize) -> Vec<f32> {
    let mut row = vec![0.0; len];
    for (&t, &v) in at.iter().zip(values) {
        row[t] = v;
    }
    row
}

/// Advantages, returns, KL, corrections for the step's episodes. `old`, `reference` and
/// `values` are full-length per-position rows from the worker's forward (one per episode).
pub fn prepare(
    recipe: &StepRecipe,
    episodes: &[Episode],
    old: Vec<Vec<f32>>,
    reference: Option<Vec<Vec<f32>>>,
    values: Option<Vec<Vec<f32>>>,
) -> Result<PreparedEpisodes> {
    let n = episodes.len();
    for (what, len) in [
        ("old", Some(old.len())),
        ("reference", reference.as_ref().map(Vec::len)),
        ("values", values.as_ref().map(Vec::len)),
    ] {
        if let Some(len) = len {
            if len != n {
                return Err(Error::Other(format!("{what} log-probs for {len} episodes, expected {n}")));
            }
        }
    }
    let at: Vec<Vec<usize>> = episodes.iter().map(|e| positions(&e.sequence.mask)).collect();
    let lens: Vec<usize> = episodes.iter().map(|e| e.sequence.mask.len()).collect();
    let mut metrics = Metrics::new();

    // Compacted rows: sampled positions only.
    let c_mask: Vec<Vec<f32>> = at.iter().map(|a| vec![1.0; a.len()]).collect();
    let c_old: Vec<Vec<f32>> = old.iter().zip(&at).map(|(r, a)| compact(r, a)).collect();
    let c_roll: Vec<Vec<f32>> = episodes.iter().zip(&at).map(|(e, a)| compact(&e.sequence.logprobs, a)).collect();
    let c_ref: Option<Vec<Vec<f32>>> =
        reference.as_ref().map(|r| r.iter().zip(&at).map(|(r, a)| compact(r, a)).collect());
    let c_values: Option<Vec<Vec<f32>>> =
        values.as_ref().map(|v| v.iter().zip(&at).map(|(r, a)| compact(r, a)).collect());

    let mut c_rewards: Vec<Vec<f32>> = episodes
        .iter()
        .zip(&at)
        .map(|(e, a)| {
            let mut r = vec![0.0; a.len()];
            if let Some(last) = r.last_mut() {
                *last = e.reward as f32;
            }
            r
        })
        .collect();
    if let Some(c_ref) = &c_ref {
        let (mut sum, mut count) = (0.0, 0.0);
        for (i, (o, r)) in c_old.iter().zip(c_ref).enumerate() {
            for (t, (&o, &r)) in o.iter().zip(r).enumerate() {
                let kl = recipe.kl_estimator.estimate(o as f64, r as f64);
                sum += kl;
                count += 1.0;
                if recipe.kl_in_reward {
                    c_rewards[i][t] -= (recipe.kl_coef * kl) as f32;
                }
            }
        }
        metrics.add_mean("kl", sum, count);
    }
    let groups: Vec<usize> = episodes.iter().map(|e| e.group).collect();
    let adv = recipe.advantage.compute(&c_rewards, c_values.as_deref(), &c_mask, &groups)?;
    let (c_kept, c_is) = match &recipe.off_policy {
        Some(correction) => {
            let out = correction.apply(&c_old, &c_roll, &c_mask)?;
            metrics.merge(&out.metrics);
            (out.mask, out.is_weights)
        }
        None => (c_mask.clone(), c_mask.clone()),
    };
    let full = |rows: &[Vec<f32>]| -> Vec<Vec<f32>> {
        rows.iter().zip(&at).zip(&lens).map(|((r, a), &len)| scatter(r, a, len)).collect()
    };
    Ok(PreparedEpisodes {
        mask: full(&c_kept),
        roll: full(&c_roll),
        token_rewards: full(&c_rewards),
        advantages: full(&adv.advantages),
        returns: full(&adv.returns),
        is_weights: full(&c_is),
        old,
        reference,
        values,
        metrics,
    })
}

/// Splits the groups of a step into `k` mini-batches of whole groups, in order; returns the
/// episode indices of each.
pub fn minibatches(episodes: &[Episode], k: usize) -> Vec<Vec<usize>> {
    let mut groups: Vec<usize> = episodes.iter().map(|e| e.group).collect();
    groups.dedup();
    let k = k.clamp(1, groups.len().max(1));
    let per = groups.len().div_ceil(k);
    groups
        .chunks(per)
        .map(|chunk| (0..episodes.len()).filter(|&i| chunk.contains(&episodes[i].group)).collect())
        .collect()
}

/// The policy datums of one mini-batch (`members`: episode indices), with the reduction's
/// weights computed over that mini-batch.
pub fn policy_datums(
    recipe: &StepRecipe,
    episodes: &[Episode],
    prep: &PreparedEpisodes,
    members: &[usize],
) -> Result<Vec<Datum>> {
    let weights = reduction_weights(recipe, episodes, prep, members)?;
    let kl_in_loss = recipe.kl_coef != 0.0 && !recipe.kl_in_reward;
    Ok(members
        .iter()
        .zip(weights)
        .map(|(&i, w)| {
            let s = &episodes[i].sequence;
            Datum {
                input_tokens: s.input_tokens.clone(),
                loss_fn_inputs: LossFnInputs {
                    target_tokens: Some(s.target_tokens.clone()),
                    weights: Some(w),
                    logprobs: Some(prep.old[i].clone()),
                    advantages: Some(prep.advantages[i].clone()),
                    rollout_logprobs: Some(prep.roll[i].clone()),
                    ref_logprobs: if kl_in_loss { prep.reference.as_ref().map(|r| r[i].clone()) } else { None },
                    ..Default::default()
                },
            }
        })
        .collect())
}

/// The critic datums of one mini-batch: the same weights, old values and returns.
pub fn critic_datums(
    recipe: &StepRecipe,
    episodes: &[Episode],
    prep: &PreparedEpisodes,
    members: &[usize],
) -> Result<Vec<Datum>> {
    let values = prep.values.as_ref().ok_or_else(|| Error::Other("critic datums need values".into()))?;
    let weights = reduction_weights(recipe, episodes, prep, members)?;
    Ok(members
        .iter()
        .zip(weights)
        .map(|(&i, w)| {
            let s = &episodes[i].sequence;
            Datum {
                input_tokens: s.input_tokens.clone(),
                loss_fn_inputs: LossFnInputs {
                    weights: Some(w),
                    values: Some(values[i].clone()),
                    returns: Some(prep.returns[i].clone()),
                    ..Default::default()
                },
            }
        })
        .collect())
}

/// Reduction weights over the mini-batch, times the off-policy IS weights (0 where masked).
fn reduction_weights(
    recipe: &StepRecipe,
    episodes: &[Episode],
    prep: &PreparedEpisodes,
    members: &[usize],
) -> Result<Vec<Vec<f32>>> {
    let mask: Vec<Vec<f32>> = members.iter().map(|&i| prep.mask[i].clone()).collect();
    let groups: Vec<usize> = members.iter().map(|&i| episodes[i].group).collect();
    let w = crate::algo::loss_reduction_weights(recipe.reduction, &mask, &groups)?;
    Ok(w.into_iter()
        .zip(members)
        .map(|(row, &i)| row.iter().zip(&prep.is_weights[i]).map(|(&w, &f)| w * f).collect())
        .collect())
}
