//! `oxrl rl`: reinforcement learning from a TOML config (see `oxrl config show --kind rl`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::launch::rl_runtime;
use crate::trainer::rl::run_rl;
use crate::trainer::sft::RunOptions;
use crate::trainer::RlConfig;

#[derive(clap::Args)]
pub struct Args {
    /// The run's TOML config.
    #[arg(long)]
    config: PathBuf,
    /// Override a config key, e.g. `--set rollout.n_samples=4` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Continue from the latest checkpoint in output.run_dir.
    #[arg(long)]
    resume: bool,
}

pub fn run(a: Args, threads: Option<usize>) -> anyhow::Result<()> {
    let cfg = RlConfig::load(Some(&a.config), &a.sets)?;
    let (dispatch, engines) = rl_runtime(&cfg, threads)?;
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    // First Ctrl-C: finish the step, checkpoint, exit. A second one exits at once.
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: saving a checkpoint after this step (Ctrl-C again to quit now)");
    })?;
    let opts = RunOptions { resume: a.resume, interrupt: Some(interrupt), progress: true, ..Default::default() };
    let s = run_rl(&cfg, &dispatch, &engines, &opts)?;
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
