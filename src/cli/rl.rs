//! `oxrl rl`: reinforcement learning from a TOML config (see `oxrl config show --kind rl`).

use super::run_args::RunArgs;
use crate::launch::rl_runtime;
use crate::trainer::rl::{run_rl_on, RlTask};
use crate::trainer::RlConfig;

pub fn run(a: RunArgs, threads: Option<usize>) -> anyhow::Result<()> {
    let mut cfg = RlConfig::load(Some(&a.config), &a.sets)?;
    cfg.model.resolve()?;
    let opts = a.options()?;
    // The user's Python code and data are checked before any model is loaded.
    let task = RlTask::prepare(&cfg, &opts)?;
    let (dispatch, engines) = rl_runtime(&cfg, threads)?;
    let s = run_rl_on(&cfg, &task, &dispatch, &engines, &opts)?;
    let eval = s
        .evals
        .last()
        .map(|(_, pass1, pass_n)| format!(", eval pass@1 {pass1:.3}, pass@{} {pass_n:.3}", cfg.rollout.eval_samples))
        .unwrap_or_default();
    eprintln!("step {}/{}: reward {:.4}{eval}", s.steps, s.total_steps, s.reward_mean);
    if let Some(dir) = &s.export_dir {
        eprintln!("model exported to {}; metrics in {}", dir.display(), s.run_dir.display());
    }
    if s.interrupted {
        anyhow::bail!("interrupted");
    }
    Ok(())
}
