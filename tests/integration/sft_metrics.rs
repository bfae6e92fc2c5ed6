//! `metrics.jsonl` (write, read back, resume) and `loss.png` (a valid PNG of the right size that
//! draws the data it was given).

use oxrl::trainer::metrics::{read_metrics, MetricsWriter, StepMetrics, METRICS_FILE};
use oxrl::trainer::plot::{plot_loss, plot_run, PlotConfig, EVAL_COLOR, LOSS_PLOT_FILE, TRAIN_COLOR};
use serde_json::{json, Value};

use crate::png_pixels::{decode_png, mean_y, pixels_of};

fn record(step: usize, loss: f64, eval_loss: Option<f64>) -> StepMetrics {
    StepMetrics {
        step,
        loss,
        lr: 1e-3,
        grad_norm: 0.5,
        trained_tokens: 10,
        tokens: 40,
        tokens_per_s: 400.0,
        elapsed_s: step as f64,
        eval_loss,
        ..Default::default()
    }
}

#[test]
fn metrics_lines_round_trip_and_resume_drops_later_steps() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = MetricsWriter::create(dir.path()).unwrap();
    let mut extra = record(3, f64::NAN, Some(1.5));
    extra.extra.insert("clip_fraction:mean".into(), json!(0.25));
    for m in [record(1, 2.0, None), record(2, 1.8, None), extra] {
        w.write(&m).unwrap();
    }
    drop(w);
    let path = dir.path().join(METRICS_FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["step"], 1);
    assert_eq!(lines[0]["loss"], 2.0);
    assert!(lines[0].get("eval_loss").is_none(), "no eval_loss key on steps without eval");
    assert_eq!(lines[2]["loss"], Value::Null, "NaN is written as null");
    assert_eq!(lines[2]["eval_loss"], 1.5);
    assert_eq!(lines[2]["clip_fraction:mean"], 0.25, "extra metrics are top-level keys");
    for key in ["step", "epoch", "loss", "lr", "grad_norm", "trained_tokens", "tokens", "tokens_per_s", "elapsed_s"] {
        assert!(lines[0].get(key).is_some(), "{key}");
    }

    let back = read_metrics(&path).unwrap();
    assert_eq!(back[..2], [record(1, 2.0, None), record(2, 1.8, None)]);
    assert!(back[2].loss.is_nan());
    assert_eq!(back[2].extra["clip_fraction:mean"], json!(0.25));

    // Resumed after step 2: step 3 is dropped, new steps append.
    let mut w = MetricsWriter::resume(dir.path(), 2).unwrap();
    w.write(&record(3, 1.7, None)).unwrap();
    let steps: Vec<(usize, f64)> = read_metrics(&path).unwrap().iter().map(|m| (m.step, m.loss)).collect();
    assert_eq!(steps, [(1, 2.0), (2, 1.8), (3, 1.7)]);

    std::fs::write(&path, "{\"step\": 1}\nnot json\n").unwrap();
    let e = read_metrics(&path).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl") && e.contains("line 1"), "{e}");
}

#[test]
fn loss_plot_is_a_png_of_the_requested_size_that_draws_the_curves() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = PlotConfig { width: 640, height: 400 };
    let train: Vec<(f64, f64)> = (1..=100).map(|s| (s as f64, 3.0 * (-(s as f64) / 30.0).exp() + 0.2)).collect();
    let eval: Vec<(f64, f64)> =
        (1..=10).map(|i| (10.0 * i as f64, 3.0 * (-(10.0 * i as f64) / 40.0).exp() + 0.4)).collect();
    let path = dir.path().join("down.png");
    plot_loss(&path, &train, &eval, &cfg).unwrap();
    let img = decode_png(&path);
    assert_eq!((img.0, img.1), (640, 400));
    let (tr, ev) = (pixels_of(&img, TRAIN_COLOR), pixels_of(&img, EVAL_COLOR));
    assert!(tr.len() > 300 && ev.len() > 100, "train {} and eval {} pixels", tr.len(), ev.len());
    // A falling curve: the train pixels are high on the left and low on the right.
    let (left, right) = (mean_y(&tr, 0, 200), mean_y(&tr, 440, 640));
    assert!(left + 100.0 < right, "train curve left y {left} should be well above right y {right}");
    // Text was drawn (the caption and axis labels are black or near-black).
    let dark = img.2.chunks(3).filter(|p| p.iter().all(|&c| c < 60)).count();
    assert!(dark > 500, "{dark} dark pixels: axes and text");

    // The same plot of a rising curve is the mirror image: the picture follows the data.
    let rising: Vec<(f64, f64)> = train.iter().map(|&(s, l)| (s, 3.4 - l)).collect();
    let up = dir.path().join("up.png");
    plot_loss(&up, &rising, &[], &cfg).unwrap();
    let img = decode_png(&up);
    let tr = pixels_of(&img, TRAIN_COLOR);
    assert!(mean_y(&tr, 0, 200) > mean_y(&tr, 440, 640) + 100.0);
    assert!(pixels_of(&img, EVAL_COLOR).is_empty(), "no eval series, no eval pixels");
}

#[test]
fn plot_run_reads_metrics_and_writes_loss_png() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = MetricsWriter::create(dir.path()).unwrap();
    for s in 1..=30 {
        let eval = (s % 10 == 0).then(|| 2.0 - s as f64 / 30.0);
        w.write(&record(s, 2.5 - s as f64 / 20.0, eval)).unwrap();
    }
    w.write(&record(31, f64::INFINITY, None)).unwrap(); // a diverged step is skipped, not fatal
    let path = plot_run(dir.path(), &PlotConfig::default()).unwrap();
    assert_eq!(path, dir.path().join(LOSS_PLOT_FILE));
    let img = decode_png(&path);
    assert_eq!((img.0, img.1), (800, 500));
    assert!(!pixels_of(&img, EVAL_COLOR).is_empty());
}
