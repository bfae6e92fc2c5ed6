//! Run configs: defaults, file, `--set` overrides, and the errors for unknown keys (with the
//! nearest valid key), wrong types and bad values; `oxrl config show` end to end.

use std::path::{Path, PathBuf};
use std::process::Command;

use oxrl::error::nearest_name;
use oxrl::trainer::config_file::{self, edit_distance, parse_set, schema_keys, suggest};
use oxrl::trainer::sections::{OnBadRow, OptimizerSection, ScheduleKind};
use oxrl::trainer::sft::config::{SftConfig, TrainOn};
use oxrl::worker::AdamParams;
use serde::{Deserialize, Serialize};

const MINIMAL: &str = "[model]\npath = \"runs/m\"\n[data]\ntrain_file = \"d.jsonl\"\n";

fn file_with(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("run.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn load_err(text: &str, sets: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = file_with(dir.path(), text);
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    SftConfig::load(Some(&path), &sets).unwrap_err().to_string()
}

fn sets(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

#[test]
fn defaults_round_trip_through_toml_and_list_every_key() {
    let d = SftConfig::default();
    let text = d.to_toml().unwrap();
    let back: SftConfig = toml::from_str(&text).unwrap();
    assert_eq!(back, d);
    let keys = schema_keys::<SftConfig>().unwrap();
    for k in [
        "model.path",
        "model.dtype",
        "model.lora.rank",
        "model.lora.alpha",
        "model.lora.targets",
        "data.train_file",
        "data.eval_file",
        "data.eval_fraction",
        "data.max_length",
        "data.train_on",
        "data.on_bad_row",
        "data.shuffle_seed",
        "optimizer.lr",
        "optimizer.betas",
        "optimizer.eps",
        "optimizer.weight_decay",
        "optimizer.grad_clip_norm",
        "schedule.kind",
        "schedule.warmup_steps",
        "schedule.min_lr_ratio",
        "train.batch_size",
        "train.micro_batch_size",
        "train.epochs",
        "train.max_steps",
        "train.eval_every",
        "train.checkpoint_every",
        "train.seed",
        "output.run_dir",
    ] {
        assert!(keys.contains(&k.to_string()), "{k} missing from the schema");
    }
}

#[test]
fn optimizer_defaults_are_the_adam_params_table() {
    let tinker =
        AdamParams { learning_rate: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0.0, grad_clip_norm: 0.0 };
    assert_eq!(AdamParams::default(), tinker);
    let o = SftConfig::default().optimizer;
    assert_eq!(
        o,
        OptimizerSection { lr: 1e-4, betas: [0.9, 0.95], eps: 1e-12, weight_decay: 0.0, grad_clip_norm: 0.0 }
    );
    assert_eq!(o.adam_params(o.lr), tinker);
    let o = OptimizerSection { lr: 2e-3, betas: [0.8, 0.99], eps: 1e-8, weight_decay: 0.1, grad_clip_norm: 1.0 };
    let step =
        AdamParams { learning_rate: 5e-4, beta1: 0.8, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, grad_clip_norm: 1.0 };
    assert_eq!(o.adam_params(5e-4), step, "the lr is the schedule's");
}

#[test]
fn paths_in_a_file_are_relative_to_it_and_set_paths_to_the_working_directory() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("configs");
    std::fs::create_dir(&sub).unwrap();
    let text = "[model]\npath = \"../models/m\"\n[data]\ntrain_file = \"d.jsonl\"\neval_file = \"/abs/e.jsonl\"\n";
    let path = file_with(&sub, text);
    let c = SftConfig::load(Some(&path), &[]).unwrap();
    assert_eq!(c.model.path, sub.join("../models/m"));
    assert_eq!(c.data.train_file, sub.join("d.jsonl"));
    assert_eq!(c.data.eval_file, PathBuf::from("/abs/e.jsonl"), "absolute paths stay");
    assert_eq!(c.output.run_dir, PathBuf::from("runs/sft"), "a default is not from the file");
    let c = SftConfig::load(Some(&path), &sets(&["data.train_file=x.jsonl", "output.run_dir=runs/a"])).unwrap();
    assert_eq!(c.data.train_file, PathBuf::from("x.jsonl"), "--set paths are relative to the working directory");
    assert_eq!(c.output.run_dir, PathBuf::from("runs/a"));
    assert_eq!(c.model.path, sub.join("../models/m"));
    let c: SftConfig = config_file::resolve(Some(&path), &[]).unwrap();
    assert_eq!(c.model.path, sub.join("../models/m"), "resolve does the same");
    let keys = schema_keys::<SftConfig>().unwrap();
    for key in <SftConfig as config_file::ConfigPaths>::PATH_KEYS {
        assert!(keys.contains(&key.to_string()), "{key} is not a key");
    }
}

#[test]
fn file_then_set_overrides_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let text = "[model]\npath = \"runs/m\"\n\
                [data]\ntrain_file = \"d.jsonl\"\ntrain_on = \"last_assistant\"\n\
                [optimizer]\nlr = 1\nbetas = [0.8, 0.9]\n";
    let path = file_with(dir.path(), text);
    let c = SftConfig::load(Some(&path), &[]).unwrap();
    assert_eq!(c.optimizer.lr, 1.0, "an integer where a float is expected is accepted");
    assert_eq!(c.optimizer.betas, [0.8, 0.9]);
    assert_eq!(c.data.train_on, TrainOn::LastAssistant);
    assert_eq!(c.train.batch_size, 32, "untouched keys keep their defaults");

    let c = SftConfig::load(
        Some(&path),
        &sets(&[
            "optimizer.lr=2e-5",
            "optimizer.lr=3e-5",
            "model.path=runs/other",
            "schedule.kind=\"cosine\"",
            "data.on_bad_row=skip",
            "optimizer.betas=[0.9, 0.95]",
            "model.lora={rank = 8, targets = [\"q_proj\"]}",
        ]),
    )
    .unwrap();
    assert_eq!(c.optimizer.lr, 3e-5, "the last --set wins");
    assert_eq!(c.model.path, PathBuf::from("runs/other"), "bare strings need no quotes");
    assert_eq!(c.schedule.kind, ScheduleKind::Cosine);
    assert_eq!(c.data.on_bad_row, OnBadRow::Skip);
    assert_eq!(c.optimizer.betas, [0.9, 0.95]);
    assert_eq!((c.model.lora.rank, c.model.lora.alpha), (8, 32.0), "a --set table merges into the section");
    assert_eq!(c.model.lora.targets, ["q_proj"]);

    let c = SftConfig::load(Some(&path), &sets(&["model.path=1e3", "model.dtype=bf16"])).unwrap();
    assert_eq!(c.model.path, PathBuf::from("1e3"), "a string key keeps the text as typed");
    assert_eq!(c.model.dtype, "bf16");
}

#[test]
fn unknown_keys_in_the_file_name_the_dotted_key_and_suggest_the_nearest() {
    let e = load_err(&format!("{MINIMAL}[optimizer]\nlrr = 1e-4\n"), &[]);
    assert!(
        e.contains("run.toml") && e.contains("`optimizer.lrr`") && e.contains("did you mean `optimizer.lr`?"),
        "{e}"
    );
    let e = load_err(&format!("{MINIMAL}[model.lora]\nrnak = 4\n"), &[]);
    assert!(e.contains("`model.lora.rnak`") && e.contains("did you mean `model.lora.rank`?"), "{e}");
    // A key in the wrong section is found in the right one.
    let e = load_err(&format!("{MINIMAL}[train]\nlr = 1e-4\n"), &[]);
    assert!(e.contains("`train.lr`") && e.contains("did you mean `optimizer.lr`?"), "{e}");
    let e = load_err(&format!("{MINIMAL}[optimiser]\nlr = 1e-4\n"), &[]);
    assert!(e.contains("`optimiser`") && e.contains("did you mean `optimizer`?"), "{e}");
    // Nothing close: the valid keys are listed instead.
    let e = load_err(&format!("{MINIMAL}[output]\nzzzzzzzz = 1\n"), &[]);
    assert!(e.contains("`output.zzzzzzzz`") && e.contains("valid keys here: run_dir"), "{e}");
}

#[test]
fn wrong_types_and_bad_values_name_the_key() {
    let e = load_err(&format!("{MINIMAL}[optimizer]\nlr = \"fast\"\n"), &[]);
    assert!(
        e.contains("run.toml") && e.contains("`optimizer.lr`") && e.contains("expected a float, found a string"),
        "{e}"
    );
    let e = load_err(&format!("{MINIMAL}[train]\nbatch_size = 1.5\n"), &[]);
    assert!(e.contains("`train.batch_size`") && e.contains("expected an integer, found a float"), "{e}");
    let e = load_err(&format!("{MINIMAL}[schedule]\nkind = \"cosin\"\n"), &[]);
    assert!(e.contains("`schedule.kind`") && e.contains("unknown variant `cosin`") && e.contains("`cosine`"), "{e}");
    let e = load_err(&format!("{MINIMAL}[train]\nepochs = -1\n"), &[]);
    assert!(e.contains("`train.epochs`") && e.contains("-1"), "{e}");
    let e = load_err(&format!("optimizer = 3\n{MINIMAL}"), &[]);
    assert!(e.contains("`optimizer`") && e.contains("expected a table"), "{e}");
    let e = load_err("[model]\npath = \"m\"\n", &[]);
    assert!(e.contains("`data.train_file`") && e.contains("required"), "{e}");
    let e = load_err(&format!("{MINIMAL}[train]\nbatch_size = 10\nmicro_batch_size = 4\n"), &[]);
    assert!(e.contains("`train.micro_batch_size`") && e.contains("divide"), "{e}");
    let e = load_err(MINIMAL, &["data.eval_fraction=1.5"]);
    assert!(e.contains("--set data.eval_fraction=1.5") && e.contains("[0, 1)"), "{e}");
    let e = load_err("[model\n", &[]);
    assert!(e.contains("run.toml") && e.contains("invalid TOML"), "{e}");
}

#[test]
fn optimizer_and_schedule_ranges_name_the_key_in_both_configs() {
    // The `[optimizer]` and `[schedule]` checks belong to their sections, so that the SFT and
    // the RL config check them alike; the SFT config's errors are the sections' own.
    let cases: [(&str, &str); 9] = [
        ("optimizer.lr=0", "`optimizer.lr`: must be positive"),
        ("optimizer.lr=nan", "`optimizer.lr`: must be positive"),
        ("optimizer.betas=[0.9, 1.0]", "`optimizer.betas`: each must be in [0, 1)"),
        ("optimizer.betas=[-0.1, 0.9]", "`optimizer.betas`: each must be in [0, 1)"),
        ("optimizer.eps=0", "`optimizer.eps`: must be positive"),
        ("optimizer.weight_decay=-1", "`optimizer.weight_decay`: must be non-negative"),
        ("optimizer.grad_clip_norm=inf", "`optimizer.grad_clip_norm`: must be non-negative (0 disables)"),
        ("schedule.min_lr_ratio=1.5", "`schedule.min_lr_ratio`: must be in [0, 1]"),
        ("schedule.min_lr_ratio=-0.1", "`schedule.min_lr_ratio`: must be in [0, 1]"),
    ];
    for (set, message) in cases {
        let e = load_err(MINIMAL, &[set]);
        assert!(e.contains(&format!("--set {set}")) && e.contains(message), "{set}: {e}");
        let c: SftConfig =
            config_file::resolve(None, &sets(&["model.path=m", "data.train_file=d.jsonl", set])).unwrap();
        let none = config_file::Sources::none();
        let own = c.optimizer.validate(&none).and_then(|()| c.schedule.validate(&none)).unwrap_err().to_string();
        assert_eq!(own, format!("invalid input: config key {message}"), "{set}");
        assert_eq!(c.validate(&none).unwrap_err().to_string(), own, "{set}");
    }
    let d = SftConfig::default();
    d.optimizer.validate(&config_file::Sources::none()).unwrap();
    d.schedule.validate(&config_file::Sources::none()).unwrap();
}

#[test]
fn set_errors_name_the_argument() {
    let e = load_err(MINIMAL, &["optimizer.lrr=2e-5"]);
    assert!(e.contains("--set optimizer.lrr=2e-5") && e.contains("did you mean `optimizer.lr`?"), "{e}");
    let e = load_err(MINIMAL, &["lr=2e-5"]);
    assert!(e.contains("did you mean `optimizer.lr`?"), "{e}");
    let e = load_err(MINIMAL, &["optimizer.lr=fast"]);
    assert!(e.contains("--set optimizer.lr=fast") && e.contains("expected a float, found a string"), "{e}");
    let e = load_err(MINIMAL, &["optimizer.lr"]);
    assert!(e.contains("expected KEY=VALUE"), "{e}");
    let e = load_err(MINIMAL, &["optimizer.betas=[0.9, \"x\"]"]);
    assert!(e.contains("--set optimizer.betas") && e.contains("`optimizer.betas[1]`"), "{e}");
    let e = load_err(MINIMAL, &["data.train_on=first_assistant"]);
    assert!(e.contains("--set data.train_on") && e.contains("unknown variant `first_assistant`"), "{e}");
}

#[test]
fn set_values_parse_as_toml_scalars() {
    use toml::Value;
    assert_eq!(parse_set("a.b=2e-5").unwrap(), ("a.b".to_string(), Value::Float(2e-5)));
    assert_eq!(parse_set("a=3").unwrap().1, Value::Integer(3));
    assert_eq!(parse_set("a=true").unwrap().1, Value::Boolean(true));
    assert_eq!(parse_set("a=\"x y\"").unwrap().1, Value::String("x y".into()));
    assert_eq!(parse_set("a=runs/x").unwrap().1, Value::String("runs/x".into()));
    assert_eq!(parse_set(" a = 1 ").unwrap(), ("a".to_string(), Value::Integer(1)));
    assert!(parse_set("a..b=1").is_err());
    assert!(parse_set("=1").is_err());
}

#[test]
fn suggestions_by_edit_distance() {
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(edit_distance("lr", "lr"), 0);
    assert_eq!(edit_distance("rnak", "rank"), 1, "a swap is one edit");
    let keys: Vec<String> = ["optimizer", "optimizer.lr", "optimizer.eps", "train", "train.epochs", "train.seed"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(suggest("optimizer.esp", &keys).as_deref(), Some("optimizer.eps"));
    assert_eq!(suggest("train.epoch", &keys).as_deref(), Some("train.epochs"));
    assert_eq!(suggest("train.epochs_total_count", &keys), None);
    assert_eq!(suggest("seed", &keys).as_deref(), Some("train.seed"));
    assert_eq!(suggest("optimizer.ep", &keys).as_deref(), Some("optimizer.eps"), "an abbreviation");
    let keys: Vec<String> = ["a", "a.lr", "b", "b.lr"].iter().map(|s| s.to_string()).collect();
    assert_eq!(suggest("b.x.lr", &keys).as_deref(), Some("b.lr"), "the key nearest the whole typed key");
}

/// The one rule behind every "did you mean" (config keys here, loss and estimator names in algo).
#[test]
fn nearest_name_prefers_few_edits_then_abbreviations() {
    let names = ["ppo", "cispo", "clip_low_threshold", "clip_high_threshold", "epochs"];
    assert_eq!(nearest_name("ppoo", &names), Some("ppo"));
    assert_eq!(nearest_name("cipso", &names), Some("cispo"), "a swap is one edit");
    assert_eq!(nearest_name("clip_low", &names), Some("clip_low_threshold"), "contained: an abbreviation");
    assert_eq!(nearest_name("clip", &names), Some("clip_low_threshold"), "the first containing it");
    assert_eq!(nearest_name("epochs_total_count", &names), None, "containing a name is not enough");
    assert_eq!(nearest_name("dpo", &names), Some("ppo"), "1 edit for a short word");
    assert_eq!(nearest_name("po", &names), Some("ppo"));
    assert_eq!(nearest_name("xy", &names), None);
    assert_eq!(nearest_name("ep", &names), None, "no abbreviation under 3 chars");
    assert_eq!(nearest_name("anything", &[]), None);
}

/// The mechanism is generic: another config type (the RL config, later) gets the same checks.
#[test]
fn the_mechanism_serves_any_config_type() {
    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Rl {
        rollout: Rollout,
    }
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Rollout {
        group_size: usize,
        temperature: f64,
    }
    impl config_file::ConfigPaths for Rl {}
    impl Default for Rollout {
        fn default() -> Self {
            Rollout { group_size: 8, temperature: 1.0 }
        }
    }
    let c: Rl = config_file::resolve(None, &sets(&["rollout.temperature=0.7"])).unwrap();
    assert_eq!(c.rollout, Rollout { group_size: 8, temperature: 0.7 });
    let e = config_file::resolve::<Rl>(None, &sets(&["rollout.group_sise=4"])).unwrap_err().to_string();
    assert!(e.contains("did you mean `rollout.group_size`?"), "{e}");
}

// ---------------------------------------------------------------- the command line

fn oxrl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oxrl")).args(args).output().unwrap()
}

#[test]
fn config_show_prints_defaults_and_resolved_configs() {
    let out = oxrl(&["config", "show", "--kind", "sft"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shown: SftConfig = toml::from_str(&String::from_utf8(out.stdout).unwrap()).unwrap();
    assert_eq!(shown, SftConfig::default());

    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/sft_tiny.toml");
    let out = oxrl(&[
        "config",
        "show",
        "--config",
        example.to_str().unwrap(),
        "--set",
        "optimizer.lr=2e-5",
        "--set",
        "train.epochs=3",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shown: SftConfig = toml::from_str(&String::from_utf8(out.stdout).unwrap()).unwrap();
    let mut expect = SftConfig::load(Some(&example), &[]).unwrap();
    expect.optimizer.lr = 2e-5;
    expect.train.epochs = 3;
    assert_eq!(shown, expect);

    let out = oxrl(&["config", "show", "--config", example.to_str().unwrap(), "--set", "optimizer.lrr=1"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--set optimizer.lrr=1") && stderr.contains("did you mean `optimizer.lr`?"), "{stderr}");
}
