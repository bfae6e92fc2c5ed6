//! What every training subcommand takes (`oxrl sft`, `oxrl rl`) and how it is interrupted.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::trainer::RunOptions;

#[derive(clap::Args)]
pub struct RunArgs {
    /// The run's TOML config.
    #[arg(long)]
    pub config: PathBuf,
    /// Override a config key, e.g. `--set optimizer.lr=2e-5` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Continue from the latest checkpoint in output.run_dir.
    #[arg(long)]
    pub resume: bool,
}

impl RunArgs {
    /// Run options with a Ctrl-C handler installed: the first Ctrl-C finishes the step, saves a
    /// checkpoint and stops; a second one exits at once.
    pub fn options(&self) -> anyhow::Result<RunOptions> {
        let interrupt = Arc::new(AtomicBool::new(false));
        let flag = interrupt.clone();
        ctrlc::set_handler(move || {
            if flag.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
            eprintln!("\ninterrupted: saving a checkpoint after this step (Ctrl-C again to quit now)");
        })?;
        Ok(RunOptions { resume: self.resume, interrupt: Some(interrupt), progress: true, ..Default::default() })
    }
}
