//! `oxrl sft`: supervised fine-tuning from a TOML config (see `oxrl config show --kind sft`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::launch::sft_dispatch;
use crate::trainer::sft::{run_sft, RunOptions};
use crate::trainer::SftConfig;

#[derive(clap::Args)]
pub struct Args {
    /// The run's TOML config.
    #[arg(long)]
    config: PathBuf,
    /// Override a config key, e.g. `--set optimizer.lr=2e-5` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Continue from the latest checkpoint in output.run_dir.
    #[arg(long)]
    resume: bool,
}

pub fn run(a: Args, threads: Option<usize>) -> anyhow::Result<()> {
    let cfg = SftConfig::load(Some(&a.config), &a.sets)?;
    // Data-parallel ranks are threads: by default the cores are shared among them.
    let dispatch = sft_dispatch(&cfg, threads)?;
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
    let s = run_sft(&cfg, &dispatch, &opts)?;
    let eval = s.eval_losses.last().map(|(_, e)| format!(", eval loss {e:.4}")).unwrap_or_default();
    eprintln!("step {}/{}: train loss {:.4}{eval}", s.steps, s.total_steps, s.final_loss);
    if let Some(dir) = &s.export_dir {
        eprintln!("model exported to {}; metrics and loss.png in {}", dir.display(), s.run_dir.display());
    }
    if s.interrupted {
        anyhow::bail!("interrupted");
    }
    Ok(())
}
