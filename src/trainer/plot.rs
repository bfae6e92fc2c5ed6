//! Plots of a run's metrics against step, as PNGs in the run directory: `loss.png` for SFT
//! ([`plot_run`]); `reward.png`, `eval_accuracy.png`, `response_length.png`, `kl.png` and
//! `entropy.png` for RL ([`plot_rl_run`]).
//!
//! One drawing function, [`plot_series`], draws every plot: named series of `(step, value)`
//! points, each in its colour, with a legend. Which metrics keys go into which file is data:
//! a [`MetricPlot`] per file ([`LOSS_PLOT`], [`RL_PLOTS`]).
//!
//! Drawn with plotters' bitmap backend. Text needs a font and this crate must not depend on the
//! fonts of the machine, so DejaVu Sans Mono (Bitstream Vera licence, `assets/fonts/`) is
//! compiled in and registered with plotters as `sans-serif` on first use. Non-finite values
//! (a diverged step; `null` in `metrics.jsonl`) are left out of the plot rather than wrecking its
//! scale. A series with few points (as eval series usually are) is marked with dots as well as
//! joined.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::prelude::*;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::trainer::metrics::{read_metric_lines, METRICS_FILE};

pub const LOSS_PLOT_FILE: &str = "loss.png";

/// matplotlib's first colour, tab:blue: the train series, and the first series of every plot.
pub const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
/// matplotlib's second colour, tab:orange: the eval series, and the second series of a plot.
pub const EVAL_COLOR: RGBColor = RGBColor(255, 127, 14);
/// tab:green.
pub const GREEN: RGBColor = RGBColor(44, 160, 44);
/// tab:red.
pub const RED: RGBColor = RGBColor(214, 39, 40);
/// tab:purple.
pub const PURPLE: RGBColor = RGBColor(148, 103, 189);

/// Points of a series closer than this many pixels apart (on average) are not marked with dots.
const DOT_SPACING_PX: f64 = 10.0;

static FONT: &[u8] = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/fonts/DejaVuSansMono.ttf"));

/// Size of the plot.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlotConfig {
    /// Width in pixels. Default 800.
    pub width: u32,
    /// Height in pixels. Default 500.
    pub height: u32,
}

impl Default for PlotConfig {
    fn default() -> Self {
        PlotConfig { width: 800, height: 500 }
    }
}

/// One plot of metrics lines: the file it is written to and the keys it draws.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MetricPlot {
    /// File name in the run directory, e.g. `reward.png`.
    pub file: &'static str,
    /// Caption above the plot.
    pub title: &'static str,
    /// Y axis label.
    pub y_label: &'static str,
    /// `(metrics key, legend label, colour)` of each series.
    pub series: &'static [(&'static str, &'static str, RGBColor)],
}

/// SFT: train and eval loss (`loss.png`).
pub const LOSS_PLOT: MetricPlot = MetricPlot {
    file: LOSS_PLOT_FILE,
    title: "loss",
    y_label: "loss",
    series: &[("loss", "train", TRAIN_COLOR), ("eval_loss", "eval", EVAL_COLOR)],
};

/// RL: the plots [`plot_rl_run`] writes, each only if some line has one of its keys.
pub const RL_PLOTS: [MetricPlot; 6] = [
    MetricPlot {
        file: "reward.png",
        title: "reward",
        y_label: "mean reward",
        series: &[("reward_mean", "train", TRAIN_COLOR)],
    },
    MetricPlot {
        file: "eval_accuracy.png",
        title: "eval accuracy",
        y_label: "accuracy",
        series: &[("eval_pass_at_1", "pass@1", TRAIN_COLOR), ("eval_pass_at_n", "pass@n", EVAL_COLOR)],
    },
    MetricPlot {
        file: "response_length.png",
        title: "response length",
        y_label: "mean tokens",
        series: &[("response_length_mean", "train", GREEN)],
    },
    MetricPlot {
        file: "kl.png",
        title: "KL to the reference",
        y_label: "mean KL",
        series: &[("kl_mean", "train", RED)],
    },
    MetricPlot {
        file: "entropy.png",
        title: "entropy",
        y_label: "mean entropy",
        series: &[("entropy_mean", "train", PURPLE)],
    },
    MetricPlot {
        file: "staleness.png",
        title: "staleness (async)",
        y_label: "steps",
        series: &[("staleness_mean", "mean", TRAIN_COLOR), ("staleness_max", "max", EVAL_COLOR)],
    },
];

impl MetricPlot {
    /// Whether some line has one of the plot's keys (even as `null`).
    pub fn present_in(&self, lines: &[Map<String, Value>]) -> bool {
        lines.iter().any(|l| self.series.iter().any(|(key, _, _)| l.contains_key(*key)))
    }

    /// The `(step, value)` points of each series, in the order of [`MetricPlot::series`]: from
    /// every line with an integer `step` and the key; `null` is NaN (and left out when drawn).
    pub fn points(&self, lines: &[Map<String, Value>]) -> Vec<Vec<(f64, f64)>> {
        self.series
            .iter()
            .map(|(key, _, _)| {
                lines
                    .iter()
                    .filter_map(|l| {
                        let step = l.get("step")?.as_u64()? as f64;
                        let v = l.get(*key)?;
                        Some((step, if v.is_null() { f64::NAN } else { v.as_f64()? }))
                    })
                    .collect()
            })
            .collect()
    }

    /// Draws `points` (one list per series, as [`MetricPlot::points`] gives) to `path`.
    pub fn draw_points(&self, path: &Path, points: Vec<Vec<(f64, f64)>>, cfg: &PlotConfig) -> Result<()> {
        let series: Vec<Series> =
            self.series.iter().zip(points).map(|(&(_, label, color), p)| (label, color, p)).collect();
        plot_series(path, self.title, self.y_label, &series, cfg)
    }

    /// Draws the plot of `lines` to `run_dir/FILE`; returns the path.
    pub fn draw(&self, run_dir: &Path, lines: &[Map<String, Value>], cfg: &PlotConfig) -> Result<PathBuf> {
        let path = run_dir.join(self.file);
        self.draw_points(&path, self.points(lines), cfg)?;
        Ok(path)
    }
}

/// One labelled series: `(label, colour, (step, value) points)`.
pub type Series<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

/// Writes a PNG to `path` of the named `(label, colour, (step, value) points)` series against
/// step, with a legend. Non-finite points are left out; an empty series is not drawn (nor put in
/// the legend); a series whose points are far apart is marked with dots too.
pub fn plot_series(path: &Path, title: &str, y_label: &str, series: &[Series], cfg: &PlotConfig) -> Result<()> {
    register_font();
    let err = |e: &dyn std::fmt::Display| Error::file(path, format!("cannot draw the {title} plot: {e}"));
    let series: Vec<Series> = series
        .iter()
        .map(|(label, color, points)| {
            (*label, *color, points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect())
        })
        .filter(|(_, _, points): &(_, _, Vec<_>)| !points.is_empty())
        .collect();
    let (mut x0, mut x1, mut y0, mut y1) = series
        .iter()
        .flat_map(|(_, _, p)| p)
        .fold((f64::MAX, f64::MIN, f64::MAX, f64::MIN), |(a, b, c, d), &(x, y)| {
            (a.min(x), b.max(x), c.min(y), d.max(y))
        });
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1.0 {
        x1 = x0 + 1.0;
    }
    // 5% headroom so the curves do not run along the frame; a flat series gets a unit range.
    let pad = if y1 > y0 { 0.05 * (y1 - y0) } else { 0.5 };
    let (y0, y1) = ((y0 - pad).max(if y0 >= 0.0 { 0.0 } else { f64::MIN }), y1 + pad);

    let root = BitMapBackend::new(path, (cfg.width, cfg.height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .margin_right(28)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|x| format!("{}", x.round() as i64))
        .y_desc(y_label)
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| err(&e))?;
    let plot_width = chart.plotting_area().dim_in_pixel().0 as f64;
    for (label, color, points) in &series {
        let color = *color;
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        // Mean pixel distance between neighbouring points.
        let (first, last) = (points[0].0, points[points.len() - 1].0);
        let spacing = (last - first).abs() / (x1 - x0) * plot_width / (points.len().max(2) - 1) as f64;
        if points.len() == 1 || spacing >= DOT_SPACING_PX {
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|e| err(&e))?;
        }
    }
    if !series.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Writes a PNG of `train` and `eval` `(step, loss)` series to `path` ([`LOSS_PLOT`]).
pub fn plot_loss(path: &Path, train: &[(f64, f64)], eval: &[(f64, f64)], cfg: &PlotConfig) -> Result<()> {
    LOSS_PLOT.draw_points(path, vec![train.to_vec(), eval.to_vec()], cfg)
}

/// Reads `run_dir/metrics.jsonl` and writes `run_dir/loss.png`; returns the PNG's path.
pub fn plot_run(run_dir: &Path, cfg: &PlotConfig) -> Result<PathBuf> {
    LOSS_PLOT.draw(run_dir, &read_metric_lines(&run_dir.join(METRICS_FILE))?, cfg)
}

/// Reads `run_dir/metrics.jsonl` of an RL run and writes each of [`RL_PLOTS`] into `run_dir`
/// whose metrics appear in some line (a plot whose keys no line has is skipped: no file, no
/// error); returns the paths written.
pub fn plot_rl_run(run_dir: &Path, cfg: &PlotConfig) -> Result<Vec<PathBuf>> {
    let lines = read_metric_lines(&run_dir.join(METRICS_FILE))?;
    RL_PLOTS.iter().filter(|p| p.present_in(&lines)).map(|p| p.draw(run_dir, &lines, cfg)).collect()
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid TTF compiled in; a failure here is a build defect.
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .unwrap_or_else(|_| panic!("the bundled font does not parse"));
    });
}
