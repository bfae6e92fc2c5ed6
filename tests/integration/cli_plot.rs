//! `oxrl plot`: one metric of several runs on one PNG; a missing run directory and an unknown
//! metric are errors naming them.

use std::path::Path;
use std::process::{Command, Output};

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
    let png = std::fs::read(&out).unwrap();
    assert!(png.len() > 1000 && png.starts_with(b"\x89PNG"), "not a PNG");
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
