//! `RUN_DIR/config.toml` keeps its meaning: the run saves its resolved config with absolute
//! paths (`config_file::absolutize`), so reusing that file with `--config`, from wherever it
//! lies, gives the same config, although relative paths in a config file are relative to the
//! file.

use std::path::{Path, PathBuf};

use oxrl::launch::sft_dispatch;
use oxrl::trainer::config_file::absolutize;
use oxrl::trainer::sft::run_sft;
use oxrl::trainer::RunOptions;
use oxrl::trainer::SftConfig;

const ROWS: &str = concat!(
    r#"{"messages":[{"role":"user","content":"what is 12 plus 30?"},{"role":"assistant","content":"42"}]}"#,
    "\n",
    r#"{"messages":[{"role":"user","content":"say hi"},{"role":"assistant","content":"hi"}]}"#,
    "\n",
);

fn canon(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The path fields of the SFT config, in `PATH_KEYS` order.
fn paths(cfg: &SftConfig) -> [&Path; 4] {
    [&cfg.model.path, &cfg.data.train_file, &cfg.data.eval_file, &cfg.output.run_dir]
}

#[test]
fn absolutize_makes_set_paths_absolute_and_leaves_empty_ones_empty() {
    // `--set` paths are relative to the working directory (the crate root under cargo test).
    let sets: Vec<String> = [
        "model.path=tests/fixtures/hf/qwen3",
        "data.train_file=tests/../tests/fixtures/hf/qwen3/config.json",
        "output.run_dir=target/tmp/no-such-run-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cfg = SftConfig::load(None, &sets).unwrap();
    assert!(cfg.model.path.is_relative());
    let abs = absolutize(&cfg).unwrap();
    let root = canon(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert_eq!(abs.model.path, root.join("tests/fixtures/hf/qwen3"));
    assert_eq!(abs.data.train_file, root.join("tests/fixtures/hf/qwen3/config.json"), "canonical: no `..`");
    assert!(abs.output.run_dir.is_absolute() && abs.output.run_dir.ends_with("target/tmp/no-such-run-dir"));
    assert!(!abs.output.run_dir.exists(), "a path that does not exist is made absolute, not created");
    assert_eq!(abs.data.eval_file, PathBuf::new(), "an unset path stays unset");
    // Everything else is unchanged, and absolutizing again changes nothing.
    let mut back = abs.clone();
    (back.model.path, back.data.train_file, back.output.run_dir) =
        (cfg.model.path.clone(), cfg.data.train_file.clone(), cfg.output.run_dir.clone());
    assert_eq!(back, cfg);
    assert_eq!(absolutize(&abs).unwrap(), abs);
}

#[test]
fn the_saved_run_config_loads_to_the_same_config_from_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["cfg", "data", "elsewhere"] {
        std::fs::create_dir(d.join(sub)).unwrap();
    }
    std::fs::write(d.join("data/train.jsonl"), ROWS).unwrap();
    // Paths relative to the config file, one of them through `..`.
    let file = d.join("cfg/run.toml");
    std::fs::write(
        &file,
        "[data]\ntrain_file = \"../data/train.jsonl\"\n[train]\nbatch_size = 2\nmicro_batch_size = 1\n\
         max_steps = 1\neval_every = 0\n[output]\nrun_dir = \"../run\"\n",
    )
    .unwrap();
    // And one relative to the working directory, given with --set.
    let cfg = SftConfig::load(Some(&file), &["model.path=tests/fixtures/hf/qwen3".to_string()]).unwrap();
    assert!(cfg.model.path.is_relative());
    let dispatch = sft_dispatch(&cfg, Some(1)).unwrap();
    let summary = run_sft(&cfg, &dispatch, &RunOptions::default()).unwrap();
    assert_eq!(summary.steps, 1);

    let saved_file = canon(&d.join("run/config.toml"));
    let text = std::fs::read_to_string(&saved_file).unwrap();
    let saved = SftConfig::load(Some(&saved_file), &[]).unwrap();
    for (orig, saved) in paths(&cfg).into_iter().zip(paths(&saved)) {
        if orig.as_os_str().is_empty() {
            assert!(saved.as_os_str().is_empty(), "an unset path stays unset: {text}");
        } else {
            assert!(saved.is_absolute() && !text.contains(".."), "{}: {text}", saved.display());
            assert_eq!(saved, canon(orig), "the saved path names the same file");
        }
    }
    assert_eq!(saved, absolutize(&cfg).unwrap());

    // The same file copied elsewhere still means the same config.
    let copy = d.join("elsewhere/config.toml");
    std::fs::copy(&saved_file, &copy).unwrap();
    assert_eq!(SftConfig::load(Some(&copy), &[]).unwrap(), saved);
}
