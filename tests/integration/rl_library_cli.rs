//! The RL entry point called as a library (`launch::rl_runtime` + `trainer::rl::run_rl`) and
//! `oxrl rl --config` compute the same run: thread budgets are options given to the launcher,
//! never process-wide settings the command line makes, so the two train with the same threads and
//! export bit-identical weights.

use crate::common;

use std::path::Path;

use oxrl::trainer::rl::run_rl;
use oxrl::trainer::RlConfig;
use oxrl::trainer::RunOptions;

/// Every safetensors file of `run/final/`, by name.
fn exported(run: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(run.join("final"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    files.sort();
    files
}

#[test]
fn a_library_run_equals_the_command_line_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_byte_model(&model, 32, 256, 7);
    let sets: Vec<String> = [
        format!("model.path={}", model.display()),
        "data.synthetic_train=16".into(),
        "data.synthetic_eval=4".into(),
        "rollout.n_samples=4".into(),
        "env.max_turn_tokens=4".into(),
        "train.prompts_per_step=4".into(),
        "train.max_steps=2".into(),
        "train.mini_batches=2".into(),
        "optimizer.lr=1e-3".into(),
        "algorithm.kl.coef=0.05".into(),
        // The default budgets: trainer threads 0 = the cores, one engine thread.
        "launch.trainer_threads=0".into(),
    ]
    .into();
    let config = tmp.path().join("rl.toml");
    std::fs::write(&config, RlConfig::load(None, &sets).unwrap().to_toml().unwrap()).unwrap();

    let lib_run = tmp.path().join("lib");
    let cfg = RlConfig::load(Some(&config), &[format!("output.run_dir={}", lib_run.display())]).unwrap();
    let (dispatch, engines) = oxrl::launch::rl_runtime(&cfg, None).unwrap();
    let s = run_rl(&cfg, &dispatch, &engines, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 2);
    drop((dispatch, engines));

    let cli_run = tmp.path().join("cli");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oxrl"))
        .args(["rl", "--config"])
        .arg(&config)
        .arg("--set")
        .arg(format!("output.run_dir={}", cli_run.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "oxrl rl failed: {}", String::from_utf8_lossy(&out.stderr));

    let (lib, cli) = (exported(&lib_run), exported(&cli_run));
    assert!(!lib.is_empty(), "the library run exported no safetensors");
    assert_eq!(lib.iter().map(|f| &f.0).collect::<Vec<_>>(), cli.iter().map(|f| &f.0).collect::<Vec<_>>());
    for ((name, a), (_, b)) in lib.iter().zip(&cli) {
        assert!(a == b, "{name}: the library's export differs from oxrl rl's");
    }
}
