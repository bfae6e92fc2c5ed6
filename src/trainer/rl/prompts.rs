//! The prompts of an RL run: the synthetic arithmetic sets, or `data.train_file` with
//! `data.eval_file` or an `eval_fraction` held out by the one eval split of oxrl
//! ([`split_eval`], the SFT trainer's too).

use super::config::RlConfig;
use crate::env::{generate_arithmetic, load_prompts_for, sample_arithmetic, EnvFactory, PromptOptions, PromptRow};
use crate::trainer::eval_split::split_eval;
use crate::Result;

/// The train and eval prompts of a run.
pub fn load_rl_prompts(cfg: &RlConfig, envs: &EnvFactory) -> Result<(Vec<PromptRow>, Vec<PromptRow>)> {
    let d = &cfg.data;
    let options =
        PromptOptions { default_env: Some(d.env.clone()), on_bad_row: d.on_bad_row, config: cfg.env.env_config() };
    if d.is_synthetic() {
        let generate = if d.synthetic_eval_disjoint { generate_arithmetic } else { sample_arithmetic };
        return generate(&d.arithmetic_spec(), d.synthetic_train, d.synthetic_eval, d.shuffle_seed);
    }
    let train = load_prompts_for(&d.train_file, &options, envs)?.rows;
    if !d.eval_file.as_os_str().is_empty() {
        return Ok((train, load_prompts_for(&d.eval_file, &options, envs)?.rows));
    }
    Ok(split_eval(train, d.eval_fraction, d.shuffle_seed))
}
