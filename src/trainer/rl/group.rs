//! A group: the `n` episodes of one prompt, the unit that RL advantages (GRPO, RLOO), the
//! group filters and staleness control work on, and what both sources of episodes hand the RL
//! loop.
//!
//! A group's identity is `(step, round, index)`: the prompt `index` of the sync trainer's step
//! `step` (from 0), in sampling round `round` of dynamic sampling. Its sampling seed is a function
//! of that identity alone ([`GroupId::seed`]), so the async trainer's group `k` — identity
//! `(k / prompts_per_step, 0, k mod prompts_per_step)` — samples what the sync trainer's does.
//! A step's groups are trained in identity order.

use serde::{Deserialize, Serialize};

use super::episodes::{generate_groups, prompt_seed, Episode};
use crate::env::{EnvFactory, PromptRow};
use crate::model::tokenizer::Tokenizer;
use crate::rollout::{EngineClient, SamplingParams};
use crate::world::{share, World};
use crate::Result;

/// Where a group sits in the run: see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GroupId {
    /// The sync step it belongs to, from 0.
    pub step: usize,
    /// The dynamic-sampling round (0 unless `dynamic_sampling = "replace"` sampled more).
    pub round: usize,
    /// Its prompt's place in the step's batch.
    pub index: usize,
}

impl GroupId {
    /// The async stream's group `k`: prompt `k mod per_step` of step `k / per_step`, round 0.
    pub fn of_stream(k: u64, per_step: usize) -> GroupId {
        let per_step = per_step as u64;
        GroupId { step: (k / per_step) as usize, round: 0, index: (k % per_step) as usize }
    }

    /// The group's sampling seed, from the run's `train.seed` and the identity alone.
    pub fn seed(&self, train_seed: u64) -> u64 {
        let step_seed = train_seed.wrapping_mul(1_000_003).wrapping_add(self.step as u64);
        prompt_seed(step_seed.wrapping_mul(31).wrapping_add(self.round as u64), self.index)
    }
}

/// A finished group.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Group {
    pub id: GroupId,
    /// The training step (from 1) being worked on when its generation started; a group trained
    /// in step `s` is `s − start_step` steps stale.
    pub start_step: u64,
    /// Its episodes, in sample order.
    pub episodes: Vec<Episode>,
}

/// Which groups have no learning signal and are dropped before training.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupFilter {
    /// Drop a group whose rewards are all equal (`algorithm.zero_variance_filter`).
    pub equal_rewards: bool,
    /// Drop a group whose episodes are all correct or all wrong (`algorithm.dynamic_sampling`).
    pub equal_verdicts: bool,
}

impl GroupFilter {
    /// Whether `episodes` (one group) are kept for training.
    pub fn keeps(&self, episodes: &[Episode]) -> bool {
        let same_reward = episodes.windows(2).all(|w| w[0].reward == w[1].reward);
        let same_verdict = episodes.windows(2).all(|w| w[0].correct == w[1].correct);
        let dropped = (self.equal_rewards && same_reward) || (self.equal_verdicts && same_verdict);
        !dropped
    }
}

/// The episodes of a step's groups, in order, each numbered with its group's place (what
/// advantages and mini-batches group by).
pub fn step_episodes(groups: &[Group]) -> Vec<Episode> {
    let mut episodes = vec![];
    for (i, g) in groups.iter().enumerate() {
        episodes.extend(g.episodes.iter().cloned().map(|e| Episode { group: i, ..e }));
    }
    episodes
}

/// What the RL trainers sample groups with: the engines, the prompts' environments and
/// sampling settings, `n` episodes a group; in a run of several processes, each samples its
/// share of the groups on its own engines and they exchange them.
pub struct GroupSampler<'a> {
    pub world: &'a dyn World,
    pub engines: &'a EngineClient,
    pub tok: &'a Tokenizer,
    pub envs: &'a EnvFactory,
    pub params: SamplingParams,
    pub n: usize,
    /// `train.seed`: with a group's identity, its sampling seed.
    pub train_seed: u64,
}

impl GroupSampler<'_> {
    /// One group per prompt, `prompts[i]` as group `ids[i]`, all submitted at once; groups come
    /// back in order, each marked as started in training step `start_step`. Process `p` of `W`
    /// samples the groups `i mod W = p` (a group's seed is its identity's, so which process
    /// samples it does not change it); rewards are computed where the whole group is.
    pub fn sample(&self, prompts: &[PromptRow], ids: &[GroupId], start_step: u64) -> Result<Vec<Group>> {
        share(self.world, ids.len(), |mine| {
            let prompts: Vec<PromptRow> = mine.iter().map(|&i| prompts[i].clone()).collect();
            let seeds: Vec<u64> = mine.iter().map(|&i| ids[i].seed(self.train_seed)).collect();
            let episodes = generate_groups(self.engines, self.tok, &prompts, &seeds, self.envs, &self.params, self.n)?;
            let groups = mine.iter().zip(episodes.chunks(self.n.max(1)));
            Ok(groups.map(|(&i, chunk)| Group { id: ids[i], start_step, episodes: chunk.to_vec() }).collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::TrainingSequence;

    fn group(rewards: &[f64], correct: &[bool]) -> Vec<Episode> {
        let sequence = TrainingSequence {
            input_tokens: vec![],
            target_tokens: vec![],
            mask: vec![],
            logprobs: vec![],
            turn: vec![],
        };
        rewards
            .iter()
            .zip(correct)
            .map(|(&reward, &correct)| Episode {
                group: 0,
                uid: String::new(),
                sequence: sequence.clone(),
                reward,
                correct,
                truncated: false,
                turns: 1,
                response_tokens: 0,
                min_version: 0,
                versions: vec![],
                data_source: None,
                reward_metrics: Default::default(),
                user_error: false,
            })
            .collect()
    }

    /// `zero_variance_filter` drops a group of equal rewards (whatever its verdicts); dynamic
    /// sampling drops a group of equal verdicts (`correct`), even when format rewards differ.
    #[test]
    fn the_filters_test_what_their_docs_say() {
        let none = GroupFilter::default();
        let zero_variance = GroupFilter { equal_rewards: true, equal_verdicts: false };
        let dynamic = GroupFilter { equal_rewards: false, equal_verdicts: true };
        let equal_rewards_mixed_verdicts = group(&[0.5, 0.5], &[true, false]);
        let mixed_rewards_all_correct = group(&[1.0, 1.1], &[true, true]);
        let signal = group(&[0.0, 1.0], &[false, true]);
        for g in [&equal_rewards_mixed_verdicts, &mixed_rewards_all_correct, &signal] {
            assert!(none.keeps(g));
        }
        assert!(!zero_variance.keeps(&equal_rewards_mixed_verdicts));
        assert!(zero_variance.keeps(&mixed_rewards_all_correct));
        assert!(dynamic.keeps(&equal_rewards_mixed_verdicts));
        assert!(!dynamic.keeps(&mixed_rewards_all_correct));
        assert!(zero_variance.keeps(&signal) && dynamic.keeps(&signal));
    }
}
