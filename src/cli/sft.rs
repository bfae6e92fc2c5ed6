//! `oxrl sft`: supervised fine-tuning from a TOML config (see `oxrl config show --kind sft`).

use super::run_args::RunArgs;
use crate::launch::sft_dispatch;
use crate::trainer::sft::run_sft;
use crate::trainer::SftConfig;

pub fn run(a: RunArgs, threads: Option<usize>) -> anyhow::Result<()> {
    let mut cfg = SftConfig::load(Some(&a.config), &a.sets)?;
    cfg.model.resolve()?;
    // Data-parallel ranks are threads: by default the cores are shared among them.
    let dispatch = sft_dispatch(&cfg, threads)?;
    let opts = a.options()?;
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
