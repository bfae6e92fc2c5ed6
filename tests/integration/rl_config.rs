//! The RL run config: defaults, file, `--set` overrides, open tables (`algorithm.loss_config`,
//! `algorithm.off_policy`) checked by their parsers, every error naming the dotted key; the
//! helpers the loop uses; `oxrl config show --kind rl` and `oxrl rl` on a bad config.

use std::path::{Path, PathBuf};
use std::process::Command;

use oxrl::algo::{AdvantageEstimator, KlEstimator, Loss, LossReduction, PolicyObjective};
use oxrl::trainer::config_file::{self, schema_keys, ConfigPaths};
use oxrl::trainer::rl::config::RlConfig;
use oxrl::trainer::sections::ScheduleKind;
use serde::{Deserialize, Serialize};

const MINIMAL: &str = "[model]\npath = \"m\"\n";

fn file_with(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("rl.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn sets(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

fn load(text: &str, set: &[&str]) -> oxrl::Result<RlConfig> {
    let dir = tempfile::tempdir().unwrap();
    let path = file_with(dir.path(), text);
    RlConfig::load(Some(&path), &sets(set))
}

/// The error of a config that must fail, checked to mention every part.
#[track_caller]
fn load_err(text: &str, set: &[&str], parts: &[&str]) -> String {
    let e = match load(text, set) {
        Ok(c) => panic!("config {text:?} with {set:?} loaded, expected an error: {c:?}"),
        Err(e) => e.to_string(),
    };
    for p in parts {
        assert!(e.contains(p), "error does not mention {p:?}: {e}");
    }
    e
}

#[test]
fn defaults_round_trip_through_toml_and_list_every_key() {
    let d = RlConfig::default();
    let text = d.to_toml().unwrap();
    let back: RlConfig = toml::from_str(&text).unwrap();
    assert_eq!(back, d);
    assert_eq!(d.mode, "sync");
    assert_eq!(d.schedule.kind, ScheduleKind::Constant);
    assert_eq!(d.output.run_dir, PathBuf::from("runs/rl"));
    let keys = schema_keys::<RlConfig>().unwrap();
    for k in [
        "mode",
        "model.path",
        "model.lora.rank",
        "data.train_file",
        "data.synthetic_ops",
        "env.max_turn_tokens",
        "env.format_reward",
        "rollout.n_samples",
        "rollout.eval_temperature",
        "algorithm.advantage",
        "algorithm.loss_config",
        "algorithm.kl.coef",
        "algorithm.kl.horizon",
        "algorithm.off_policy",
        "algorithm.dynamic_sampling",
        "critic.value_clip",
        "optimizer.lr",
        "schedule.kind",
        "train.prompts_per_step",
        "launch.engine_threads",
        "output.run_dir",
    ] {
        assert!(keys.iter().any(|x| x == k), "{k} missing from {keys:?}");
    }

    // A resolved config with open tables filled in round-trips too (what RUN_DIR/config.toml holds).
    let c = load(
        MINIMAL,
        &["algorithm.loss_config.eps_clip_high=0.28", "algorithm.off_policy.tis_level=token", "algorithm.kl.coef=0.01"],
    )
    .unwrap();
    let back: RlConfig = toml::from_str(&c.to_toml().unwrap()).unwrap();
    assert_eq!(back, c);
}

#[test]
fn the_minimal_config_is_valid_and_its_helpers_parse() {
    let c = load(MINIMAL, &[]).unwrap();
    assert_eq!(c.advantage().unwrap(), AdvantageEstimator::Grpo { norm_by_std: true });
    assert_eq!(c.reduction().unwrap(), LossReduction::TokenMean);
    assert_eq!(c.kl_estimator().unwrap(), KlEstimator::K3);
    assert!(c.off_policy().unwrap().is_none());
    assert!(!c.needs_reference() && !c.needs_critic());
    assert_eq!(c.loss().unwrap().qualified_name(), "regular");
    let env = c.env.env_config();
    assert_eq!((env.format_reward, env.system_prompt.as_deref(), env.max_turn_tokens), (None, None, 256));
    let p = c.sampling_params(false);
    assert_eq!((p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed), (256, 1.0, 1.0, 0, None));
}

#[test]
fn helpers_follow_the_config() {
    let c = load(
        "[model]\npath = \"m\"\n[env]\nformat_reward = 0.1\nsystem_prompt = \"be brief\"\nmax_turn_tokens = 32\n\
         [rollout]\ntemperature = 0.7\neval_temperature = 0.0\ntop_k = 5\n\
         [algorithm]\nadvantage = \"gae\"\ngamma = 0.9\nlambda = 0.95\nreduction = \"seq_mean_token_sum_norm\"\n\
         max_seq_len = 64\n[algorithm.kl]\ncoef = 0.05\nestimator = \"k2\"\n",
        &[],
    )
    .unwrap();
    assert!(c.needs_reference() && c.needs_critic());
    assert_eq!(c.advantage().unwrap(), AdvantageEstimator::Gae { gamma: 0.9, lambda: 0.95 });
    assert_eq!(c.reduction().unwrap(), LossReduction::SeqMeanTokenSumNorm { max_seq_len: 64 });
    // The KL term goes into the policy loss...
    let Loss::Policy(p) = c.loss().unwrap() else { panic!("a policy loss") };
    assert_eq!((p.kl_coef, p.kl_estimator), (0.05, KlEstimator::K2));
    let Loss::Policy(p) = c.loss_with_kl_coef(0.2).unwrap() else { panic!("a policy loss") };
    assert_eq!(p.kl_coef, 0.2);
    assert!(matches!(c.value_loss().unwrap(), Loss::Value(_)));
    // ... unless it is in the reward.
    let mut r = c.clone();
    r.algorithm.kl.in_reward = true;
    let Loss::Policy(p) = r.loss().unwrap() else { panic!("a policy loss") };
    assert_eq!(p.kl_coef, 0.0);
    assert!(r.needs_reference());
    let env = c.env.env_config();
    assert_eq!((env.format_reward, env.system_prompt.as_deref()), (Some(0.1), Some("be brief")));
    let (train, eval) = (c.sampling_params(false), c.sampling_params(true));
    assert_eq!((train.max_tokens, train.temperature, train.top_k), (32, 0.7, 5));
    assert_eq!(eval.temperature, 0.0);
}

#[test]
fn unknown_keys_anywhere_name_the_dotted_key_and_suggest_the_nearest() {
    load_err(
        "[model]\npath = \"m\"\n[algorithm]\nadvantge = \"rloo\"\n",
        &[],
        &["algorithm.advantge", "did you mean `algorithm.advantage`?"],
    );
    load_err(
        "[model]\npath = \"m\"\n[algorithm.kl]\ncoeff = 0.1\n",
        &[],
        &["algorithm.kl.coeff", "did you mean `algorithm.kl.coef`?"],
    );
    load_err("mdoe = \"sync\"\n", &[], &["mdoe", "did you mean `mode`?"]);
    load_err(MINIMAL, &["rollout.n_sample=4"], &["--set rollout.n_sample=4", "did you mean `rollout.n_samples`?"]);
    // A key in the wrong section is found in the right one.
    load_err("[model]\npath = \"m\"\n[train]\nengines = 2\n", &[], &["train.engines", "`launch.engines`"]);
    // A wrong type names the key.
    load_err("[model]\npath = \"m\"\n[rollout]\nn_samples = \"8\"\n", &[], &["rollout.n_samples", "an integer"]);
}

#[test]
fn bad_names_and_values_name_the_dotted_key() {
    let m = MINIMAL;
    load_err(m, &["algorithm.loss=regulr"], &["algorithm.loss", "did you mean `regular`?"]);
    load_err(m, &["algorithm.loss=value"], &["algorithm.loss", "critic"]);
    load_err(m, &["algorithm.advantage=grpoo"], &["algorithm.advantage", "did you mean `grpo`?"]);
    load_err(m, &["algorithm.reduction=token_meen"], &["algorithm.reduction", "did you mean `token_mean`?"]);
    load_err(m, &["algorithm.reduction=seq_mean_token_sum_norm"], &["algorithm.max_seq_len", "max_seq_len"]);
    load_err(m, &["algorithm.off_policy.tis_levl=token"], &["algorithm.off_policy.tis_levl", "tis_level"]);
    load_err(m, &["algorithm.off_policy.tis_level=word"], &["algorithm.off_policy.tis_level", "`word`"]);
    load_err(m, &["algorithm.kl.estimator=k4"], &["algorithm.kl.estimator", "k4"]);
    load_err(m, &["algorithm.kl.coef=-1"], &["algorithm.kl.coef"]);
    load_err(m, &["algorithm.kl.adaptive=true"], &["algorithm.kl.adaptive"]);
    load_err(m, &["algorithm.dynamic_sampling=filtr"], &["algorithm.dynamic_sampling", "did you mean `filter`?"]);
    load_err(m, &["algorithm.gamma=1.5"], &["algorithm.gamma"]);
    load_err(m, &["data.env=arithmetc"], &["data.env", "did you mean `arithmetic`?"]);
    load_err(m, &["data.synthetic_ops=/"], &["data.synthetic_ops"]);
    load_err(m, &["data.synthetic_digits=0"], &["data.synthetic_digits"]);
    load_err(m, &["mode=asyncc"], &["mode", "did you mean `async`?"]);
    load_err(
        m,
        &["async_rl.weight_update=kept"],
        &["async_rl.weight_update", "unknown weight update mode `kept`", "keep, abort"],
    );
    load_err(m, &["async_rl.max_staleness=-1"], &["async_rl.max_staleness"]);
    load_err(m, &["mode=nope"], &["mode", "unknown mode `nope`", "sync"]);
    load_err(m, &["rollout.n_samples=1"], &["rollout.n_samples", "at least 2", "grpo"]);
    load_err(m, &["rollout.n_samples=1", "algorithm.advantage=rloo"], &["rollout.n_samples", "rloo"]);
    load_err(m, &["rollout.n_samples=0", "algorithm.advantage=reinforce++"], &["rollout.n_samples"]);
    load_err(m, &["rollout.top_p=0"], &["rollout.top_p"]);
    load_err(m, &["train.mini_batches=17"], &["train.mini_batches", "train.prompts_per_step (16)"]);
    load_err(m, &["train.mini_batches=0"], &["train.mini_batches"]);
    load_err(m, &["train.prompts_per_step=0"], &["train.prompts_per_step"]);
    load_err(m, &["train.update_epochs=0"], &["train.update_epochs"]);
    load_err(m, &["train.max_steps=0"], &["train.max_steps"]);
    load_err(m, &["launch.engines=0"], &["launch.engines"]);
    load_err(m, &["critic.value_clip=-1", "algorithm.advantage=gae"], &["critic.value_clip"]);
    load_err("", &[], &["model.path", "required"]);
    // A Tinker loss takes no KL term: the error says where the KL term comes from.
    load_err(m, &["algorithm.loss=ppo", "algorithm.kl.coef=0.1"], &["algorithm.kl.coef", "in_reward"]);
    assert!(load(m, &["algorithm.loss=ppo", "algorithm.kl.coef=0.1", "algorithm.kl.in_reward=true"]).is_ok());
    // n = 1 is fine where groups do not matter.
    assert!(load(m, &["rollout.n_samples=1", "algorithm.advantage=reinforce++"]).is_ok());
}

#[test]
fn errors_name_the_file_or_the_set_argument() {
    let e = load_err("[model]\npath = \"m\"\n[algorithm]\nloss = \"nope\"\n", &[], &["algorithm.loss"]);
    assert!(e.contains("rl.toml"), "{e}");
    load_err(MINIMAL, &["algorithm.loss=nope"], &["--set algorithm.loss=nope"]);
}

#[test]
fn open_tables_take_any_key_and_their_parser_checks_it() {
    // Accepted as written, from the file and from --set, overlaid key by key.
    let c = load(
        "[model]\npath = \"m\"\n[algorithm]\nloss = \"dual_clip\"\n[algorithm.loss_config]\neps_clip_low = 0.1\n\
         [algorithm.off_policy]\ntis_level = \"token\"\ntis_cap = 3.0\n",
        &["algorithm.loss_config.clip_ratio_c=4.0"],
    )
    .unwrap();
    assert_eq!(c.algorithm.loss_config.len(), 2);
    let Loss::Policy(p) = c.loss().unwrap() else { panic!("a policy loss") };
    let PolicyObjective::DualClip { band, clip_ratio_c } = p.objective else { panic!("dual clip: {p:?}") };
    assert!((band.low - 0.9).abs() < 1e-12 && clip_ratio_c == 4.0, "{band:?} {clip_ratio_c}");
    let op = c.off_policy().unwrap().expect("a correction");
    assert!(op.truncated_is.is_some());

    // The parser's complaint names the key inside the open table.
    load_err(
        "[model]\npath = \"m\"\n[algorithm.loss_config]\nclip_low = 0.5\n",
        &[],
        &["algorithm.loss_config.clip_low", "unknown config key `clip_low`"],
    );
    load_err(MINIMAL, &["algorithm.loss_config.eps_clip_low=\"wide\""], &["algorithm.loss_config.eps_clip_low"]);
    // KL settings belong in [algorithm.kl].
    load_err(MINIMAL, &["algorithm.loss_config.kl_coef=0.1"], &["algorithm.loss_config.kl_coef", "[algorithm.kl]"]);
    // The open key itself must stay a table.
    load_err(MINIMAL, &["algorithm.off_policy=3"], &["algorithm.off_policy", "expected a table"]);
}

/// Open tables are a feature of the mechanism, for any config type.
#[test]
fn open_keys_serve_any_config_type() {
    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Cfg {
        section: Section,
    }
    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Section {
        name: String,
        extra: toml::Table,
        nested: Nested,
    }
    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Nested {
        free: toml::Table,
    }
    impl ConfigPaths for Cfg {
        const OPEN_KEYS: &'static [&'static str] = &["section.extra", "section.nested.free"];
    }
    let dir = tempfile::tempdir().unwrap();
    let path = file_with(dir.path(), "[section.extra]\nanything = 1\n[section.extra.deeper]\nx = \"y\"\n");
    let c: Cfg = config_file::resolve(
        Some(&path),
        &sets(&["section.extra.deeper.z=2", "section.nested.free.k=[1, 2]", "section.extra.anything=\"s\""]),
    )
    .unwrap();
    let extra = toml::Value::Table(c.section.extra.clone());
    assert_eq!(extra["anything"].as_str(), Some("s"));
    assert_eq!(extra["deeper"]["x"].as_str(), Some("y"));
    assert_eq!(extra["deeper"]["z"].as_integer(), Some(2));
    assert_eq!(c.section.nested.free["k"].as_array().map(Vec::len), Some(2));
    // Outside the open tables the schema still holds.
    let e = config_file::resolve::<Cfg>(None, &sets(&["section.nme=x"])).unwrap_err().to_string();
    assert!(e.contains("did you mean `section.name`?"), "{e}");
    let e = config_file::resolve::<Cfg>(None, &sets(&["section.nested.fre.a=1"])).unwrap_err().to_string();
    assert!(e.contains("section.nested.fre"), "{e}");
}

#[test]
fn paths_in_a_file_are_relative_to_it_and_set_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("configs");
    std::fs::create_dir(&sub).unwrap();
    let path = file_with(
        &sub,
        "[model]\npath = \"../model\"\n[data]\ntrain_file = \"p.jsonl\"\neval_file = \"/abs/e.jsonl\"\n\
         [output]\nrun_dir = \"out\"\n[rollout]\nn_samples = 4\n",
    );
    let c = RlConfig::load(Some(&path), &sets(&["rollout.n_samples=6", "output.run_dir=elsewhere"])).unwrap();
    assert_eq!(c.model.path, sub.join("../model"));
    assert_eq!(c.data.train_file, sub.join("p.jsonl"));
    assert_eq!(c.data.eval_file, PathBuf::from("/abs/e.jsonl"));
    assert_eq!(c.output.run_dir, PathBuf::from("elsewhere"));
    assert_eq!(c.rollout.n_samples, 6);
    // An unset path stays unset (the synthetic set).
    let c = RlConfig::load(Some(&file_with(&sub, "[model]\npath = \"m\"\n")), &[]).unwrap();
    assert!(c.data.is_synthetic() && c.data.eval_file.as_os_str().is_empty());
}

// ---------------------------------------------------------------- the command line

fn oxrl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oxrl")).args(args).output().unwrap()
}

#[test]
fn config_show_kind_rl_prints_every_default() {
    let out = oxrl(&["config", "show", "--kind", "rl"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("[algorithm]") && text.contains("advantage = \"grpo\""), "{text}");
    let shown: RlConfig = toml::from_str(&text).unwrap();
    assert_eq!(shown, RlConfig::default());

    let dir = tempfile::tempdir().unwrap();
    let path = file_with(dir.path(), MINIMAL);
    let out = oxrl(&[
        "config",
        "show",
        "--kind",
        "rl",
        "--config",
        path.to_str().unwrap(),
        "--set",
        "algorithm.loss_config.eps_clip_high=0.28",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shown: RlConfig = toml::from_str(&String::from_utf8(out.stdout).unwrap()).unwrap();
    assert_eq!(shown.algorithm.loss_config["eps_clip_high"].as_float(), Some(0.28));
}

#[test]
fn rl_with_a_typo_fails_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = file_with(dir.path(), "[model]\npath = \"m\"\n[algorithm]\nadvantge = \"grpo\"\n");
    let out = oxrl(&["rl", "--config", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "oxrl rl succeeded on a bad config");
    assert!(
        stderr.contains("algorithm.advantge") && stderr.contains("did you mean `algorithm.advantage`?"),
        "{stderr}"
    );
}

// ---------------------------------------------------------------- the launcher

/// The launcher builds the models the config needs, and the engines, on a fixture model.
#[test]
fn rl_runtime_builds_the_models_the_config_needs() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen2");
    let path = model.to_str().unwrap();
    let c = RlConfig::load(None, &sets(&[&format!("model.path={path}")])).unwrap();
    let (dispatch, engines) = oxrl::launch::rl_runtime(&c, Some(1)).unwrap();
    assert_eq!(dispatch.ids(), vec!["policy".to_string()]);
    assert_eq!(engines.engines().len(), 1);

    let c = RlConfig::load(
        None,
        &sets(&[
            &format!("model.path={path}"),
            "model.lora.rank=2",
            "algorithm.kl.coef=0.1",
            "algorithm.advantage=gae",
            "launch.engines=2",
        ]),
    )
    .unwrap();
    let (dispatch, engines) = oxrl::launch::rl_runtime(&c, Some(1)).unwrap();
    let mut ids = dispatch.ids();
    ids.sort();
    use oxrl::trainer::model_ids::{CRITIC, POLICY, REFERENCE};
    assert_eq!(ids, vec![CRITIC.to_string(), POLICY.to_string(), REFERENCE.to_string()]);
    assert_eq!(engines.engines().len(), 2);
}

/// A key that does nothing in the chosen mode is refused by name, with what it applies to; the
/// same key in its own mode loads. Setting it to its default is harmless (the saved
/// `config.toml` lists every key) and loads in both modes.
#[test]
fn keys_of_the_other_mode_are_refused_by_name() {
    let m = MINIMAL;
    for key in ["async_rl.max_staleness=2", "async_rl.max_concurrent=8", "async_rl.weight_update=\"abort\""] {
        let name = key.split('=').next().unwrap();
        load_err(m, &[key], &[name, "applies only to mode = \"async\""]);
        assert!(load(m, &["mode=\"async\"", key]).is_ok(), "{key} in async mode");
    }
    let e = load_err(m, &["mode=\"async\"", "algorithm.dynamic_sampling=\"filter\""], &["algorithm.dynamic_sampling"]);
    assert!(e.contains("replace"), "the error offers what async does instead: {e}");
    assert!(load(m, &["mode=\"async\"", "algorithm.dynamic_sampling=\"replace\""]).is_ok());
    load_err(m, &["mode=\"async\"", "algorithm.max_sampling_rounds=2"], &["algorithm.max_sampling_rounds", "sync"]);
    assert!(load(m, &["algorithm.dynamic_sampling=\"filter\"", "algorithm.max_sampling_rounds=2"]).is_ok());
    // Defaults written out (as in a run's config.toml) load in either mode.
    let d = RlConfig::default();
    for mode in ["sync", "async"] {
        assert!(load(&d.to_toml().unwrap().replacen("path = \"\"", "path = \"m\"", 1), &[&format!("mode=\"{mode}\"")])
            .is_ok());
    }
    // In a file, the error names the file.
    let e = load_err("[model]\npath = \"m\"\n[async_rl]\nmax_staleness = 3\n", &[], &["async_rl.max_staleness"]);
    assert!(e.contains("rl.toml"), "{e}");
}

/// `async_rl.max_staleness` is bounded by the run (a bound above `train.max_steps` is no bound),
/// and `max_concurrent` by what the bound lets the stream use.
#[test]
fn async_bounds_are_validated() {
    let m = MINIMAL;
    let a = "mode=\"async\"";
    load_err(m, &[a, "train.max_steps=3", "async_rl.max_staleness=4"], &["async_rl.max_staleness", "train.max_steps"]);
    assert!(load(m, &[a, "train.max_steps=3", "async_rl.max_staleness=3"]).is_ok());
    // (max_staleness + 1) · prompts_per_step groups at most can be useful at once.
    load_err(
        m,
        &[a, "train.prompts_per_step=4", "async_rl.max_staleness=1", "async_rl.max_concurrent=9"],
        &["async_rl.max_concurrent"],
    );
    assert!(load(m, &[a, "train.prompts_per_step=4", "async_rl.max_staleness=1", "async_rl.max_concurrent=8"]).is_ok());
}
