//! `oxrl plot`: one metric of several runs on one plot, e.g. the reward curves of a
//! synchronous and two asynchronous runs.
//!
//! Each `--run DIR` is a run directory with a `metrics.jsonl`; the metric's `(step, value)`
//! points of each run become one series, labelled by the matching `--label` (default: the
//! directory's name), drawn with [`crate::trainer::plot::plot_series`]. A run directory without
//! metrics, or a metric that a run never logged, is an error naming it.

use std::path::PathBuf;

use anyhow::{bail, Context};

use crate::trainer::metrics::{read_metric_lines, METRICS_FILE};
use crate::trainer::plot::{plot_series, PlotConfig, Series, EVAL_COLOR, GREEN, PURPLE, RED, TRAIN_COLOR};

#[derive(clap::Args)]
pub struct Args {
    /// A run directory holding metrics.jsonl (repeat for several runs).
    #[arg(long = "run", required = true)]
    runs: Vec<PathBuf>,
    /// The metrics.jsonl key to draw against step, e.g. reward_mean.
    #[arg(long)]
    metric: String,
    /// The PNG to write.
    #[arg(long)]
    out: PathBuf,
    /// A legend label per run, in the order of --run (default: the run directory's name).
    #[arg(long = "label")]
    labels: Vec<String>,
    /// The plot's title (default: the metric).
    #[arg(long)]
    title: Option<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if !a.labels.is_empty() && a.labels.len() != a.runs.len() {
        bail!("{} --label for {} --run: give one label per run, or none", a.labels.len(), a.runs.len());
    }
    let colors = [TRAIN_COLOR, EVAL_COLOR, GREEN, RED, PURPLE];
    let mut names = vec![];
    let mut points = vec![];
    for (i, dir) in a.runs.iter().enumerate() {
        let path = dir.join(METRICS_FILE);
        if !path.is_file() {
            bail!("run directory {}: no {METRICS_FILE} (is it an oxrl run directory?)", dir.display());
        }
        let lines = read_metric_lines(&path)?;
        let p: Vec<(f64, f64)> = lines
            .iter()
            .filter_map(|l| Some((l.get("step")?.as_f64()?, l.get(&a.metric)?.as_f64().unwrap_or(f64::NAN))))
            .collect();
        if p.is_empty() {
            let mut keys: Vec<&str> = lines.iter().flat_map(|l| l.keys().map(String::as_str)).collect();
            keys.sort_unstable();
            keys.dedup();
            bail!("metric `{}`: not in {} (its keys: {})", a.metric, path.display(), keys.join(", "));
        }
        let name = match a.labels.get(i) {
            Some(l) => l.clone(),
            None => dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().to_string()),
        };
        names.push(name);
        points.push(p);
    }
    let series: Vec<Series> =
        names.iter().zip(points).enumerate().map(|(i, (n, p))| (n.as_str(), colors[i % colors.len()], p)).collect();
    let title = a.title.as_deref().unwrap_or(&a.metric);
    plot_series(&a.out, title, &a.metric, &series, &PlotConfig::default())
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!("{}", a.out.display());
    Ok(())
}
