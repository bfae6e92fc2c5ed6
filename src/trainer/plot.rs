//! The loss plot: train and eval loss against step, as a PNG (`RUN_DIR/loss.png`).
//!
//! Drawn with plotters' bitmap backend. Text needs a font and this crate must not depend on the
//! fonts of the machine, so DejaVu Sans Mono (Bitstream Vera licence, `assets/fonts/`) is
//! compiled in and registered with plotters as `sans-serif` on first use. Non-finite losses
//! (a diverged step) are left out of the plot rather than wrecking its scale. Eval points are
//! marked with dots as well as joined, since there are usually few of them.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::prelude::*;

use crate::error::{Error, Result};
use crate::trainer::metrics::{read_metrics, METRICS_FILE};

pub const LOSS_PLOT_FILE: &str = "loss.png";

/// The train series colour (matplotlib's first, tab:blue).
pub const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
/// The eval series colour (matplotlib's second, tab:orange).
pub const EVAL_COLOR: RGBColor = RGBColor(255, 127, 14);

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

/// Writes a PNG of `train` and `eval` `(step, loss)` series to `path`.
pub fn plot_loss(path: &Path, train: &[(f64, f64)], eval: &[(f64, f64)], cfg: &PlotConfig) -> Result<()> {
    register_font();
    let err = |e: &dyn std::fmt::Display| Error::file(path, format!("cannot draw the loss plot: {e}"));
    let finite = |s: &[(f64, f64)]| -> Vec<(f64, f64)> {
        s.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect()
    };
    let (train, eval) = (finite(train), finite(eval));
    let all = train.iter().chain(&eval);
    let (mut x0, mut x1, mut y0, mut y1) = all
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
        .caption("loss", ("sans-serif", 20))
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
        .y_desc("loss")
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| err(&e))?;
    if !train.is_empty() {
        chart
            .draw_series(LineSeries::new(train.iter().copied(), TRAIN_COLOR.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("train")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], TRAIN_COLOR.stroke_width(2)));
    }
    if !eval.is_empty() {
        chart
            .draw_series(LineSeries::new(eval.iter().copied(), EVAL_COLOR.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("eval")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], EVAL_COLOR.stroke_width(2)));
        chart.draw_series(eval.iter().map(|&p| Circle::new(p, 3, EVAL_COLOR.filled()))).map_err(|e| err(&e))?;
    }
    if !train.is_empty() || !eval.is_empty() {
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

/// Reads `run_dir/metrics.jsonl` and writes `run_dir/loss.png`; returns the PNG's path.
pub fn plot_run(run_dir: &Path, cfg: &PlotConfig) -> Result<PathBuf> {
    let records = read_metrics(&run_dir.join(METRICS_FILE))?;
    let train: Vec<(f64, f64)> = records.iter().map(|m| (m.step as f64, m.loss)).collect();
    let eval: Vec<(f64, f64)> = records.iter().filter_map(|m| m.eval_loss.map(|l| (m.step as f64, l))).collect();
    let path = run_dir.join(LOSS_PLOT_FILE);
    plot_loss(&path, &train, &eval, cfg)?;
    Ok(path)
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid TTF compiled in; a failure here is a build defect.
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .unwrap_or_else(|_| panic!("the bundled font does not parse"));
    });
}
