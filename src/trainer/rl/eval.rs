//! RL evaluation: the policy samples `eval_samples` answers to each held-out prompt on the
//! engines; pass@1 is the mean correctness, pass@n the share of prompts with a correct answer.
//! Across processes each evaluates its share of the prompts (prompt `i` is seeded by `i`, so
//! the share does not change the episodes).

use super::config::RlConfig;
use super::episodes::{generate_groups, prompt_seed, Episode};
use crate::env::EnvFactory;
use crate::env::PromptRow;
use crate::model::tokenizer::Tokenizer;
use crate::rollout::EngineClient;
use crate::world::{share, World};
use crate::Result;

/// Accuracy of a set of episodes, `n` per prompt: pass@1 = mean correctness, pass@n = share of
/// prompts with at least one correct episode.
pub fn pass_rates(episodes: &[Episode]) -> (f64, f64) {
    if episodes.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let pass1 = episodes.iter().filter(|e| e.correct).count() as f64 / episodes.len() as f64;
    let mut groups: Vec<(usize, bool)> = vec![];
    for e in episodes {
        match groups.iter_mut().find(|(g, _)| *g == e.group) {
            Some((_, any)) => *any |= e.correct,
            None => groups.push((e.group, e.correct)),
        }
    }
    let passn = groups.iter().filter(|(_, any)| *any).count() as f64 / groups.len() as f64;
    (pass1, passn)
}

/// Evaluates the policy on the engines of the world's processes: (pass@1, pass@n).
pub fn evaluate(
    cfg: &RlConfig,
    envs: &EnvFactory,
    world: &dyn World,
    engines: &EngineClient,
    tok: &Tokenizer,
    prompts: &[PromptRow],
    seed: u64,
) -> Result<(f64, f64)> {
    let n = cfg.rollout.eval_samples;
    let groups: Vec<Vec<Episode>> = share(world, prompts.len(), |mine| {
        let rows: Vec<PromptRow> = mine.iter().map(|&i| prompts[i].clone()).collect();
        let seeds: Vec<u64> = mine.iter().map(|&i| prompt_seed(seed, i)).collect();
        let params = cfg.sampling_params(true);
        let episodes = generate_groups(engines, tok, &rows, &seeds, envs, &params, n)?;
        Ok(episodes.chunks(n.max(1)).map(<[Episode]>::to_vec).collect())
    })?;
    let episodes: Vec<Episode> = (groups.into_iter().enumerate())
        .flat_map(|(i, g)| g.into_iter().map(move |e| Episode { group: i, ..e }))
        .collect();
    Ok(pass_rates(&episodes))
}
