//! `oxrl plot`: one metric of several runs on one PNG; a missing run directory and an unknown
//! metric are errors naming them.

use std::path::Path;
use std::process::{Command, Output};

use oxrl::trainer::plot::{EVAL_COLOR, TRAIN_COLOR};

use crate::png_pixels::{decode_png, mean_y, pixels_of};

fn oxrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oxrl")).args(args).output().expect("cannot run the oxrl binary")
}

fn run_dir(root: &Path, name: &str, rewards: &[f64]) -> String {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let lines: Vec<String> = rewards
        .iter()
        .enumerate()
        .map(|(i, r)| format!(r#"{{"step": {}, "reward_mean": {r}, "time_train_s": 0.5}}"#, i + 1))
        .collect();
    std::fs::write(dir.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    dir.to_str().unwrap().to_string()
}

#[test]
fn plots_one_metric_of_several_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let a = run_dir(tmp.path(), "sync", &[0.1, 0.2, 0.4]);
    let b = run_dir(tmp.path(), "async", &[0.1, 0.3, 0.5]);
    let out = tmp.path().join("reward.png");
    let o = oxrl(&[
        "plot",
        "--run",
        &a,
        "--run",
        &b,
        "--metric",
        "reward_mean",
        "--out",
        out.to_str().unwrap(),
        "--label",
        "sync",
        "--label",
        "async s=1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Each run is drawn in its own colour (the first two of the palette), both rising: low
    // (large y) on the left, high on the right; the second ends higher than the first.
    let img = decode_png(&out);
    let (w, _, _) = img;
    let mut ends = vec![];
    for (run, color) in [("sync", TRAIN_COLOR), ("async s=1", EVAL_COLOR)] {
        let px = pixels_of(&img, color);
        assert!(px.len() > 50, "{run}: its series is not drawn");
        let (left, right) = (mean_y(&px, 0, w / 3), mean_y(&px, 2 * w / 3, w));
        assert!(left > right + 20.0, "{run}: rising rewards drawn from y {left} to {right}");
        ends.push(right);
    }
    assert!(ends[1] < ends[0], "the run ending at 0.5 is drawn below the one ending at 0.4: {ends:?}");
}

#[test]
fn a_missing_run_or_metric_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let a = run_dir(tmp.path(), "sync", &[0.1, 0.2]);
    let out = tmp.path().join("x.png");
    let out = out.to_str().unwrap();
    let missing = tmp.path().join("no-such-run");
    let o = oxrl(&["plot", "--run", &a, "--run", missing.to_str().unwrap(), "--metric", "reward_mean", "--out", out]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("no-such-run") && err.contains("metrics.jsonl"), "{err}");

    let o = oxrl(&["plot", "--run", &a, "--metric", "reward_meen", "--out", out]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("metric `reward_meen`") && err.contains("reward_mean"), "{err}");
    assert!(!Path::new(out).exists());

    let o = oxrl(&["plot", "--run", &a, "--metric", "reward_mean", "--out", out, "--label", "a", "--label", "b"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("one label per run"));
}
