//! `oxrl config show`: the resolved run config (defaults ← file ← `--set`) as TOML.
//!
//! With `--config FILE` the result is also validated (required keys, ranges), so `config show`
//! is the way to check a config before a run. With no file it prints the defaults of `--kind`
//! (with any `--set` applied), which are not a runnable config: `model.path` (and for SFT
//! `data.train_file`) has no default.

use std::path::PathBuf;

use crate::trainer::RlConfig;
use crate::trainer::SftConfig;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: ConfigCommand,
}

#[derive(clap::Subcommand)]
enum ConfigCommand {
    /// Print the resolved config as TOML.
    Show(ShowArgs),
}

#[derive(clap::Args)]
struct ShowArgs {
    /// The run's TOML config file; without it, the defaults of --kind.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Which config.
    #[arg(long, value_enum, default_value_t = ConfigKind::Sft)]
    kind: ConfigKind,
    /// Override one key, e.g. --set optimizer.lr=2e-5 (the value is parsed as TOML; repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

/// The kinds of run config.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum ConfigKind {
    /// `oxrl sft`.
    Sft,
    /// `oxrl rl`.
    Rl,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.command {
        ConfigCommand::Show(s) => {
            let text = match s.kind {
                ConfigKind::Sft => {
                    let config: SftConfig = match &s.config {
                        Some(path) => SftConfig::load(Some(path), &s.set)?,
                        None => crate::trainer::config_file::resolve(None, &s.set)?,
                    };
                    config.to_toml()?
                }
                ConfigKind::Rl => {
                    let config: RlConfig = match &s.config {
                        Some(path) => RlConfig::load(Some(path), &s.set)?,
                        None => crate::trainer::config_file::resolve(None, &s.set)?,
                    };
                    config.to_toml()?
                }
            };
            print!("{text}");
            Ok(())
        }
    }
}
