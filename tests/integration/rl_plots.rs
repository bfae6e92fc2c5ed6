//! RL metrics lines (`MetricsWriter::write_line`, `read_metric_lines`, resume) and the RL plots
//! (`plot_rl_run`): one PNG per metric present, of the configured size, drawing the data; none
//! for a metric no line has.

use std::path::Path;

use oxrl::trainer::metrics::{read_metric_lines, MetricsWriter, METRICS_FILE};
use oxrl::trainer::plot::{plot_rl_run, PlotConfig, EVAL_COLOR, RL_PLOTS, TRAIN_COLOR};
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::png_pixels::{decode_png, mean_y, pixels_of};

/// An RL step's line as the RL trainer writes it; eval keys only on eval steps.
fn rl_line(step: usize, eval: bool) -> Value {
    let s = step as f64;
    let mut line = json!({
        "step": step,
        "reward_mean": 0.1 + 0.8 * s / 20.0,
        "response_length_mean": 100.0 + 5.0 * s,
        "kl_mean": 0.001 * s,
        "entropy_mean": 1.5 - 0.05 * s,
        "clip_fraction": 0.02,
        "grad_norm": 0.7,
        "lr": 1e-6,
        "time_generate_s": 2.0,
        "time_reference_s": 0.5,
        "time_train_s": 1.0,
        "time_sync_s": 0.1,
        "samples_per_s": 30.0,
    });
    if eval {
        line["eval_pass_at_1"] = json!(0.2 + s / 40.0);
        line["eval_pass_at_n"] = json!(0.5 + s / 50.0);
    }
    line
}

fn write_lines(dir: &Path, lines: &[Value]) {
    let text: String = lines.iter().map(|l| l.to_string() + "\n").collect();
    std::fs::write(dir.join(METRICS_FILE), text).unwrap();
}

#[test]
fn rl_run_writes_one_plot_per_metric_of_the_configured_size() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<Value> = (1..=20).map(|s| rl_line(s, s % 5 == 0)).collect();
    write_lines(dir.path(), &lines);
    let cfg = PlotConfig { width: 640, height: 400 };
    let written = plot_rl_run(dir.path(), &cfg).unwrap();
    let files: Vec<&str> = written.iter().map(|p| p.file_name().unwrap().to_str().unwrap()).collect();
    assert_eq!(files, ["reward.png", "eval_accuracy.png", "response_length.png", "kl.png", "entropy.png"]);
    for (path, plot) in written.iter().zip(&RL_PLOTS) {
        assert_eq!(path, &dir.path().join(plot.file));
        let img = decode_png(path);
        assert_eq!((img.0, img.1), (640, 400), "{}", plot.file);
        for &(key, _, color) in plot.series {
            assert!(pixels_of(&img, color).len() > 50, "{}: series {key} not drawn", plot.file);
        }
    }

    // The reward rises: its pixels are low (large y) on the left and high on the right.
    let img = decode_png(&dir.path().join("reward.png"));
    let px = pixels_of(&img, TRAIN_COLOR);
    let (left, right) = (mean_y(&px, 0, 200), mean_y(&px, 440, 640));
    assert!(left > right + 100.0, "reward left y {left} should be well below right y {right}");
    // Both eval series are drawn, with dots (4 points each).
    let img = decode_png(&dir.path().join("eval_accuracy.png"));
    assert!(!pixels_of(&img, TRAIN_COLOR).is_empty() && !pixels_of(&img, EVAL_COLOR).is_empty());
}

#[test]
fn a_metric_no_line_has_gets_no_plot() {
    let dir = tempfile::tempdir().unwrap();
    // No eval steps, and no kl_mean anywhere (e.g. no KL penalty); one entropy value is null.
    let lines: Vec<Value> = (1..=6)
        .map(|s| {
            let mut l = rl_line(s, false);
            l.as_object_mut().unwrap().remove("kl_mean");
            if s == 3 {
                l["entropy_mean"] = Value::Null;
            }
            l
        })
        .collect();
    write_lines(dir.path(), &lines);
    let written = plot_rl_run(dir.path(), &PlotConfig::default()).unwrap();
    let names: Vec<String> = written.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["reward.png", "response_length.png", "entropy.png"]);
    assert!(!dir.path().join("eval_accuracy.png").exists());
    assert!(!dir.path().join("kl.png").exists());
    let img = decode_png(&dir.path().join("entropy.png"));
    assert_eq!((img.0, img.1), (800, 500));
}

/// A typed RL record, as the RL trainer may write it.
#[derive(Serialize)]
struct RlRecord {
    step: usize,
    reward_mean: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    eval_pass_at_1: Option<f64>,
}

#[test]
fn rl_lines_round_trip_and_resume_drops_later_steps() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = MetricsWriter::create(dir.path()).unwrap();
    for s in 1..=4 {
        w.write_line(&RlRecord { step: s, reward_mean: s as f64, eval_pass_at_1: (s == 2).then_some(0.5) }).unwrap();
    }
    w.write_line(&RlRecord { step: 5, reward_mean: f64::NAN, eval_pass_at_1: None }).unwrap();
    drop(w);
    let path = dir.path().join(METRICS_FILE);
    let lines = read_metric_lines(&path).unwrap();
    assert_eq!(lines.len(), 5);
    assert_eq!(lines[1]["eval_pass_at_1"], 0.5);
    assert!(!lines[0].contains_key("eval_pass_at_1"));
    assert_eq!(lines[4]["reward_mean"], Value::Null, "NaN is written as null");

    // Resumed after step 3: steps 4 and 5 go, the kept lines are unchanged, new ones append.
    let before = std::fs::read_to_string(&path).unwrap();
    let mut w = MetricsWriter::resume(dir.path(), 3).unwrap();
    w.write_line(&json!({"step": 4, "reward_mean": 9.0})).unwrap();
    let after = std::fs::read_to_string(&path).unwrap();
    let kept: String = before.lines().take(3).map(|l| l.to_string() + "\n").collect();
    assert!(after.starts_with(&kept), "{after}");
    let steps: Vec<(u64, f64)> = read_metric_lines(&path)
        .unwrap()
        .iter()
        .map(|l: &Map<String, Value>| (l["step"].as_u64().unwrap(), l["reward_mean"].as_f64().unwrap()))
        .collect();
    assert_eq!(steps, [(1, 1.0), (2, 2.0), (3, 3.0), (4, 9.0)]);

    // A line that is not a JSON object, or one without a step, is an error naming the file.
    std::fs::write(&path, "{\"step\": 1}\n[1, 2]\n").unwrap();
    let e = read_metric_lines(&path).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl") && e.contains("line 2"), "{e}");
    std::fs::write(&path, "{\"step\": 1}\n{\"reward_mean\": 1}\n").unwrap();
    let e = MetricsWriter::resume(dir.path(), 1).err().unwrap().to_string();
    assert!(e.contains("metrics.jsonl") && e.contains("step"), "{e}");
}
