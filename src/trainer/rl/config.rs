//! The RL run configuration: one TOML file with sections `[model]`, `[data]`, `[env]`,
//! `[rollout]`, `[algorithm]`, `[critic]`, `[optimizer]`, `[schedule]`, `[train]`, `[async_rl]`,
//! `[launch]` and `[output]`, resolved by [`config_file`](crate::trainer::config_file) (defaults ← file ← `--set`).
//!
//! Every field has a default, written on it; no field is an `Option` (an unset path is `""`, an
//! unset limit `0`). `[model]`, `[optimizer]`, `[schedule]` and `[output]` are the sections the
//! SFT config shares ([`crate::trainer::sections`]; with RL defaults: a constant schedule,
//! `runs/rl`). Two tables are free-form
//! ([`ConfigPaths::OPEN_KEYS`]): `algorithm.loss_config` (checked by the loss,
//! [`LossName::build`]) and `algorithm.off_policy` (checked by
//! [`crate::algo::OffPolicyCorrection::from_config`]); [`RlConfig::validate`] runs those parsers, so a bad key
//! in them is reported before a run starts. What the sections build (losses, the step recipe,
//! the KL controller) is [`super::plan`].
//!
//! [`LossName::build`]: crate::algo::LossName::build

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::algo::{AdaptiveKlController, AdvantageKind, KlEstimator, LossReduction, ReductionKind};
use crate::env::{EnvConfig, RewardConfig};
use crate::error::unknown_name_message as unknown;
use crate::error::{Error, Result};
use crate::rollout::{PauseMode, SamplingParams};
use crate::trainer::config_file::{ConfigPaths, Sources};
use crate::trainer::sections::{
    ModelSection, OnBadRow, OptimizerSection, OutputSection, ScheduleKind, ScheduleSection,
};
use crate::trainer::tracking::TrackingSection;
use crate::worker::{GradientSum, Sharding};

use super::plan::LossFault;

crate::choice! {
    /// How generation and training alternate.
    pub enum Mode("mode") {
        /// Each step generates its groups, trains on them, then syncs the engines' weights.
        Sync = "sync",
        /// Generation never waits for training (see `[async_rl]`); weights are updated in flight.
        Async = "async",
    }
}

crate::choice! {
    /// What happens to groups whose episodes are all correct or all wrong (DAPO's dynamic
    /// sampling: such a group has no signal under GRPO / RLOO with a 0/1 reward).
    pub enum DynamicSampling("dynamic sampling mode") {
        /// Keep them.
        None = "none",
        /// Drop them; the step trains the groups left (sync mode only).
        Filter = "filter",
        /// Drop them and sample more: sync mode, more prompts until the step has
        /// `prompts_per_step` groups or `max_sampling_rounds`; async mode, the next groups of
        /// the stream take their place.
        Replace = "replace",
    }
}

/// A full RL run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlConfig {
    /// `sync`: each step generates, scores, trains, then syncs the engines' weights. `async`:
    /// generation never waits for training (see `[async_rl]`). Default `sync`.
    pub mode: Mode,
    pub model: ModelSection,
    pub data: RlDataSection,
    pub env: EnvSection,
    pub reward: RewardConfig,
    pub rollout: RolloutSection,
    pub algorithm: AlgorithmSection,
    pub critic: CriticSection,
    pub optimizer: OptimizerSection,
    pub schedule: ScheduleSection,
    pub train: RlTrainSection,
    pub async_rl: AsyncSection,
    pub launch: LaunchSection,
    pub output: OutputSection,
    pub tracking: TrackingSection,
}

impl Default for RlConfig {
    fn default() -> Self {
        RlConfig {
            mode: Mode::Sync,
            model: ModelSection::default(),
            data: RlDataSection::default(),
            env: EnvSection::default(),
            reward: RewardConfig::default(),
            rollout: RolloutSection::default(),
            algorithm: AlgorithmSection::default(),
            critic: CriticSection::default(),
            optimizer: OptimizerSection::default(),
            schedule: ScheduleSection { kind: ScheduleKind::Constant, ..ScheduleSection::default() },
            train: RlTrainSection::default(),
            async_rl: AsyncSection::default(),
            launch: LaunchSection::default(),
            output: OutputSection { run_dir: PathBuf::from("runs/rl") },
            tracking: TrackingSection::default(),
        }
    }
}

impl ConfigPaths for RlConfig {
    const PATH_KEYS: &'static [&'static str] =
        &["model.path", "data.train_file", "data.eval_file", "output.run_dir", "reward.custom_function.path"];
    const MODEL_KEYS: &'static [&'static str] = &["model.path"];
    const OPEN_KEYS: &'static [&'static str] = &["algorithm.loss_config", "algorithm.off_policy"];
}

/// `[data]`: the prompts (see [`crate::env::prompts`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlDataSection {
    /// Training prompts, `.jsonl` or `.parquet`, one env row per line. Default `""`: a
    /// synthetic arithmetic set (`synthetic_*` below).
    pub train_file: PathBuf,
    /// Evaluation prompts. Default `""`: the synthetic eval set when training on the synthetic
    /// set, else `eval_fraction` of the training prompts.
    pub eval_file: PathBuf,
    /// Fraction of training prompts held out for evaluation when there is no `eval_file` (and
    /// `train_file` is given), chosen by `shuffle_seed`. Default 0: no evaluation.
    pub eval_fraction: f64,
    /// The env of rows without an `env` field (one of [`crate::env::ENV_NAMES`]). Default
    /// `arithmetic`.
    pub env: String,
    /// What a malformed row does: `error` (the default) or `skip` (warn and count).
    pub on_bad_row: OnBadRow,
    /// Seed of the prompt order and of the eval split. Default 0.
    pub shuffle_seed: u64,
    /// Problems in the synthetic training set. Default 2000.
    pub synthetic_train: usize,
    /// Problems in the synthetic eval set. Default 20.
    pub synthetic_eval: usize,
    /// Eval problems are held out (none of them in the training set). Default true. `false`:
    /// train and eval are independent draws from the same distribution, which may share
    /// problems — the choice for small spaces such as one-digit sums (100 problems).
    pub synthetic_eval_disjoint: bool,
    /// Digits of each synthetic operand, 1 to 9. Default 1.
    pub synthetic_digits: u32,
    /// Operators of the synthetic problems, a non-empty string over `+-*`. Default `+`.
    pub synthetic_ops: String,
}

impl Default for RlDataSection {
    fn default() -> Self {
        RlDataSection {
            train_file: PathBuf::new(),
            eval_file: PathBuf::new(),
            eval_fraction: 0.0,
            env: "arithmetic".into(),
            on_bad_row: OnBadRow::Error,
            shuffle_seed: 0,
            synthetic_train: 2000,
            synthetic_eval: 20,
            synthetic_eval_disjoint: true,
            synthetic_digits: 1,
            synthetic_ops: "+".into(),
        }
    }
}

impl RlDataSection {
    /// Whether the training prompts are the synthetic arithmetic set.
    pub fn is_synthetic(&self) -> bool {
        self.train_file.as_os_str().is_empty()
    }

    /// The synthetic set's generator settings.
    pub fn arithmetic_spec(&self) -> crate::env::ArithmeticSpec {
        crate::env::ArithmeticSpec { digits: self.synthetic_digits, ops: self.synthetic_ops.clone() }
    }
}

/// `[env]`: settings shared by every environment ([`EnvConfig`], with sentinels for its options).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvSection {
    /// Most model turns of a multi-turn episode. Default 4.
    pub max_turns: usize,
    /// Token budget of one model turn (the sampler's `max_tokens`). Default 256.
    pub max_turn_tokens: usize,
    /// Reward of a well-formed but wrong answer; negative (the default, -1) means the env's own
    /// default.
    pub format_reward: f64,
    /// A system message before every prompt. Default `""`: none (for `calculator`, its tool
    /// instructions).
    pub system_prompt: String,
    /// Role of tool-result messages: `user` (the default; every template renders it) or `tool`.
    pub tool_role: String,
    /// Python modules (file paths or import names) whose classes are environments in SkyRL-gym's
    /// text-env shape, named by a row's `env_class`; run in the `[reward]` worker pool.
    pub python_modules: Vec<String>,
}

impl Default for EnvSection {
    fn default() -> Self {
        let e = EnvConfig::default();
        EnvSection {
            max_turns: e.max_turns,
            max_turn_tokens: e.max_turn_tokens,
            format_reward: -1.0,
            system_prompt: String::new(),
            tool_role: e.tool_role,
            python_modules: vec![],
        }
    }
}

impl EnvSection {
    /// The envs' settings: a negative `format_reward` and an empty `system_prompt` are `None`.
    pub fn env_config(&self) -> EnvConfig {
        EnvConfig {
            max_turns: self.max_turns,
            max_turn_tokens: self.max_turn_tokens,
            format_reward: (self.format_reward >= 0.0).then_some(self.format_reward),
            system_prompt: (!self.system_prompt.is_empty()).then(|| self.system_prompt.clone()),
            tool_role: self.tool_role.clone(),
        }
    }
}

/// `[rollout]`: sampling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutSection {
    /// Samples per prompt (the group size of GRPO / RLOO). Default 8.
    pub n_samples: usize,
    /// Sampling temperature for training rollouts; 0 = greedy. Default 1.
    pub temperature: f64,
    /// Nucleus sampling threshold; 1 = off. Default 1.
    pub top_p: f64,
    /// Top-k truncation; 0 = off. Default 0.
    pub top_k: usize,
    /// Samples per eval prompt: evaluation reports pass@1 (mean) and pass@`eval_samples`.
    /// Default 4.
    pub eval_samples: usize,
    /// Sampling temperature at evaluation. Default 1.
    pub eval_temperature: f64,
}

impl Default for RolloutSection {
    fn default() -> Self {
        RolloutSection { n_samples: 8, temperature: 1.0, top_p: 1.0, top_k: 0, eval_samples: 4, eval_temperature: 1.0 }
    }
}

/// `[algorithm]`: advantages, the policy loss, its reduction, KL, off-policy correction,
/// dynamic sampling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmSection {
    /// Advantage estimator: `grpo`, `rloo`, `reinforce++` or `gae` (trains a critic, see
    /// `[critic]`). Default `grpo`.
    pub advantage: AdvantageKind,
    /// GRPO: divide by the group's reward standard deviation. Default true.
    pub norm_by_std: bool,
    /// Discount of `reinforce++` and `gae`. Default 1.
    pub gamma: f64,
    /// GAE λ. Default 1.
    pub lambda: f64,
    /// Policy loss, any name [`LossName::lookup`](crate::algo::LossName::lookup) takes:
    /// `regular` (PPO-clip, the default), `dual_clip`, `gspo`, `sapo`, `rollout_is`,
    /// `policy/cispo`, Tinker's `ppo`, `cispo`, `importance_sampling`, ...
    pub loss: String,
    /// The loss's own config (e.g. `eps_clip_low`, `eps_clip_high`), passed to
    /// [`LossName::build`](crate::algo::LossName::build) as JSON. Default `{}`: the loss's
    /// defaults. The KL term is set in `[algorithm.kl]`, not here.
    pub loss_config: toml::Table,
    /// Loss reduction, as per-token weights: `token_mean` (the default), `sequence_mean`,
    /// `seq_mean_token_sum_norm` (needs `max_seq_len`) or `prompt_mean`.
    pub reduction: ReductionKind,
    /// The constant length of `seq_mean_token_sum_norm`. Default 0 (unset).
    pub max_seq_len: usize,
    /// KL penalty against the reference (the initial policy).
    pub kl: KlSection,
    /// Off-policy correction of the sampler / learner mismatch, with keys `outlier_low`,
    /// `outlier_high`, `token_mask_low`, `token_mask_high`, `tis_level` (`token` | `sequence`),
    /// `tis_cap`, `sequence_mask` (`geometric` | `product`), `sequence_mask_low`,
    /// `sequence_mask_high` (see [`crate::algo::OffPolicyCorrection::from_config`]). Default `{}`: none.
    pub off_policy: toml::Table,
    /// Groups whose episodes are all correct or all wrong (the env's verdict, not the reward,
    /// which may include format rewards): `none` (keep them, the default), `filter` (drop them;
    /// sync mode only) or `replace` (drop them and sample more in their place: in sync mode
    /// more prompts until the step has `prompts_per_step` groups, or `max_sampling_rounds`; in
    /// async mode the stream's next groups).
    pub dynamic_sampling: DynamicSampling,
    /// Rounds of sampling per step at most with `dynamic_sampling = "replace"` (sync mode only:
    /// the async stream has no rounds). Default 3.
    pub max_sampling_rounds: usize,
    /// Drop groups whose rewards are all equal (zero advantage under GRPO / RLOO): they are not
    /// trained and count in no denominator. Sync mode: the step trains the groups left (or,
    /// with `dynamic_sampling = "replace"`, samples more); async mode: the stream's next groups
    /// take their place. Default false.
    pub zero_variance_filter: bool,
}

impl Default for AlgorithmSection {
    fn default() -> Self {
        AlgorithmSection {
            advantage: AdvantageKind::Grpo,
            norm_by_std: true,
            gamma: 1.0,
            lambda: 1.0,
            loss: "regular".into(),
            loss_config: toml::Table::new(),
            reduction: ReductionKind::TokenMean,
            max_seq_len: 0,
            kl: KlSection::default(),
            off_policy: toml::Table::new(),
            dynamic_sampling: DynamicSampling::None,
            max_sampling_rounds: 3,
            zero_variance_filter: false,
        }
    }
}

/// `[algorithm.kl]`: the KL penalty `coef · k(lp, ref)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlSection {
    /// Coefficient; 0 (the default) turns the penalty off and no reference model is loaded.
    pub coef: f64,
    /// Estimator: `k1`, `k2`, `k3` (the default) or `abs`.
    pub estimator: KlEstimator,
    /// false (the default): a per-token term of the policy loss (its `kl_coef`); true:
    /// subtracted from the token rewards before the advantages.
    pub in_reward: bool,
    /// Adapt the coefficient toward `target` KL. Default false.
    pub adaptive: bool,
    /// Target KL of the adaptive controller. Default 0.1.
    pub target: f64,
    /// Horizon of the adaptive controller, in samples. Default 10000.
    pub horizon: f64,
}

impl Default for KlSection {
    fn default() -> Self {
        KlSection {
            coef: 0.0,
            estimator: KlEstimator::K3,
            in_reward: false,
            adaptive: false,
            target: 0.1,
            horizon: 10000.0,
        }
    }
}

/// `[critic]`: the value model, trained only when `algorithm.advantage = "gae"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticSection {
    /// The critic's learning rate (its other AdamW settings are `[optimizer]`'s). Default 1e-4.
    pub lr: f64,
    /// Value-loss clip around the old values; 0 = no clipping. Default 0.2.
    pub value_clip: f64,
}

impl Default for CriticSection {
    fn default() -> Self {
        CriticSection { lr: 1e-4, value_clip: 0.2 }
    }
}

/// `[train]`: the loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlTrainSection {
    /// Prompts per step (each sampled `rollout.n_samples` times). Default 16.
    pub prompts_per_step: usize,
    /// Optimizer steps per update epoch: the step's groups are split into this many
    /// mini-batches. At most `prompts_per_step`. Default 1.
    pub mini_batches: usize,
    /// Passes over the step's samples. Default 1.
    pub update_epochs: usize,
    /// Steps of the run. Default 50.
    pub max_steps: usize,
    /// Evaluate every this many steps (and after the last); 0: only after the last. Default 10.
    pub eval_every: usize,
    /// Save a checkpoint every this many steps (and after the last); 0: only after the last.
    /// Default 10.
    pub checkpoint_every: usize,
    /// Seed of the sampling streams, LoRA and value-head initialisation. Default 0.
    pub seed: u64,
    /// Weight of a model with experts' load-balancing loss in the policy's loss (transformers'
    /// `router_aux_loss_coef`), scaled by each mini-batch's loss weights; 0 (the default): off.
    pub router_aux_loss_coef: f64,
}

impl Default for RlTrainSection {
    fn default() -> Self {
        RlTrainSection {
            prompts_per_step: 16,
            mini_batches: 1,
            update_epochs: 1,
            max_steps: 50,
            eval_every: 10,
            checkpoint_every: 10,
            seed: 0,
            router_aux_loss_coef: 0.0,
        }
    }
}

/// `[async_rl]`: the fully asynchronous trainer (`mode = "async"`; in sync mode a key set to
/// other than its default is an error).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AsyncSection {
    /// How many steps the policy that starts a group may lag the one that trains it; 0
    /// reproduces the synchronous trainer. Default 1.
    pub max_staleness: u64,
    /// Most groups generating at once; 0: `(max_staleness + 1) × prompts_per_step`. Default 0.
    pub max_concurrent: u64,
    /// How engines take new weights in flight: `keep` (running requests freeze, weights swap,
    /// their caches are recomputed, decoding continues) or `abort` (running requests end and
    /// continue on the new weights). Default `keep`.
    pub weight_update: PauseMode,
}

impl Default for AsyncSection {
    fn default() -> Self {
        AsyncSection { max_staleness: 1, max_concurrent: 0, weight_update: PauseMode::Keep }
    }
}

impl AsyncSection {
    /// `max_concurrent`, with 0 resolved.
    pub fn concurrency(&self, prompts_per_step: usize) -> u64 {
        if self.max_concurrent > 0 {
            self.max_concurrent
        } else {
            (self.max_staleness + 1) * prompts_per_step as u64
        }
    }

    /// The engines' pause mode for a weight update.
    pub fn pause_mode(&self) -> PauseMode {
        self.weight_update
    }
}

/// `[launch]`: workers and engines (how the run is laid out; the results do not depend on it,
/// up to float rounding and sampling order).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LaunchSection {
    /// Data-parallel ranks of each trained model (threads of this process). Default 1.
    pub data_parallel: usize,
    /// Sampling engines, each with a copy of the policy. Default 1.
    pub engines: usize,
    /// Tensor-math threads of each engine. Default 1.
    pub engine_threads: usize,
    /// Tensor-math threads of each trainer rank; 0 shares the cores among the ranks. `oxrl
    /// --threads` overrides it. Default 1.
    pub trainer_threads: usize,
    /// Sequences per forward/backward call on a rank; 0 (the default): the whole mini-batch.
    pub micro_batch_size: usize,
    /// At most this many padded tokens per micro-batch on a rank; 0 (the default): no limit.
    pub max_tokens_per_microbatch: usize,
    /// Keep only each decoder layer's input in the forward and recompute the layer in the
    /// backward, for every trained model: less memory for one more forward, the same gradients
    /// bit for bit. Default `false`.
    pub activation_checkpointing: bool,
    /// How the data-parallel ranks of each trained model share its state
    /// ([`crate::worker::Sharding`]): `none` (the default), `optimizer` (ZeRO-1), `gradients`
    /// (ZeRO-2) or `full` (ZeRO-3; a frozen reference model's weights are sliced too) — the same
    /// weights and metrics bit for bit whichever.
    pub sharding: Sharding,
    /// When the ranks' gradients are summed ([`crate::worker::GradientSum`]): `step` (the
    /// default) or `micro_batch` (after every micro-batch, so that under `full` a rank keeps
    /// only its slice of the gradients). Their bits differ; each gives the same bits under
    /// every sharding.
    pub gradient_sum: GradientSum,
    /// Engines in processes of their own (`oxrl engine`), by URL (`http://host:port`): sampling
    /// goes to them instead of `engines` engines in this process. Each must serve the model of
    /// `model.path` in `model.dtype`. An API key, if they need one, is read from the environment
    /// variable `OXRL_ENGINE_API_KEY`. Default: none.
    pub remote_engines: Vec<String>,
    /// Seconds a remote engine may leave a health probe unanswered before it is taken for down
    /// (its requests go to the others). Default 60.
    pub remote_timeout_s: f64,
}

impl Default for LaunchSection {
    fn default() -> Self {
        LaunchSection {
            data_parallel: 1,
            engines: 1,
            engine_threads: 1,
            trainer_threads: 1,
            micro_batch_size: 0,
            max_tokens_per_microbatch: 0,
            activation_checkpointing: false,
            sharding: Sharding::None,
            gradient_sum: GradientSum::Step,
            remote_engines: vec![],
            remote_timeout_s: 60.0,
        }
    }
}

impl RlConfig {
    /// Defaults ← `file` ← `--set` overrides, then [`validate`](Self::validate).
    pub fn load(file: Option<&Path>, sets: &[String]) -> Result<Self> {
        let (config, sources): (RlConfig, _) = crate::trainer::config_file::resolve_with_sources(file, sets)?;
        config.validate(&sources)?;
        Ok(config)
    }

    /// Checks what types cannot: required fields, names (run through the parsers the loop
    /// uses) and value ranges. Errors name the dotted key and where its value came from.
    pub fn validate(&self, sources: &Sources) -> Result<()> {
        let err = |key: &str, msg: &dyn std::fmt::Display| sources.error(key, msg);
        let wrap = |key: &str, e: Error| parser_error(sources, key, e);
        self.validate_mode_keys(sources)?;
        self.model.validate(sources)?;
        self.validate_data(sources)?;

        let env = &self.env;
        if env.max_turns == 0 {
            return Err(err("env.max_turns", &"must be positive"));
        }
        if env.max_turn_tokens == 0 {
            return Err(err("env.max_turn_tokens", &"must be positive"));
        }
        if !env.format_reward.is_finite() {
            return Err(err("env.format_reward", &"must be finite (negative: the env's default)"));
        }
        if env.tool_role.is_empty() {
            return Err(err("env.tool_role", &"must not be empty (user or tool)"));
        }
        self.validate_reward(sources)?;

        let coef = self.train.router_aux_loss_coef;
        if !(coef.is_finite() && coef >= 0.0) {
            return Err(err("train.router_aux_loss_coef", &"must be finite and non-negative"));
        }
        let r = &self.rollout;
        if r.n_samples == 0 {
            return Err(err("rollout.n_samples", &"must be positive"));
        }
        if r.n_samples < 2 && matches!(self.algorithm.advantage, AdvantageKind::Grpo | AdvantageKind::Rloo) {
            return Err(err(
                "rollout.n_samples",
                &format!(
                    "must be at least 2 with algorithm.advantage = \"{}\" (a group of one sample has zero advantage)",
                    self.algorithm.advantage
                ),
            ));
        }
        for (key, t) in [("rollout.temperature", r.temperature), ("rollout.eval_temperature", r.eval_temperature)] {
            if !non_negative(t) {
                return Err(err(key, &"must be non-negative (0 = greedy)"));
            }
        }
        if !(r.top_p.is_finite() && r.top_p > 0.0 && r.top_p <= 1.0) {
            return Err(err("rollout.top_p", &"must be in (0, 1]"));
        }
        if r.eval_samples == 0 {
            return Err(err("rollout.eval_samples", &"must be positive"));
        }

        self.validate_algorithm(sources)?;

        if self.needs_critic() {
            if !positive(self.critic.lr) {
                return Err(err("critic.lr", &"must be positive"));
            }
            self.value_loss().map_err(|e| wrap("critic.value_clip", e))?;
        }

        self.optimizer.validate(sources)?;
        self.schedule.validate(sources)?;

        let t = &self.train;
        if t.prompts_per_step == 0 {
            return Err(err("train.prompts_per_step", &"must be positive"));
        }
        if t.mini_batches == 0 || t.mini_batches > t.prompts_per_step {
            return Err(err(
                "train.mini_batches",
                &format!("must be between 1 and train.prompts_per_step ({})", t.prompts_per_step),
            ));
        }
        if t.update_epochs == 0 {
            return Err(err("train.update_epochs", &"must be positive"));
        }
        if t.max_steps == 0 {
            return Err(err("train.max_steps", &"must be positive"));
        }

        if self.mode == Mode::Async {
            let a = &self.async_rl;
            if a.max_staleness > t.max_steps as u64 {
                return Err(err(
                    "async_rl.max_staleness",
                    &format!("must be at most train.max_steps ({}): a larger bound changes nothing", t.max_steps),
                ));
            }
            let most = (a.max_staleness + 1) * t.prompts_per_step as u64;
            if a.max_concurrent > most {
                return Err(err(
                    "async_rl.max_concurrent",
                    &format!(
                        "must be at most (async_rl.max_staleness + 1) × train.prompts_per_step = {most}: \
                         staleness control never runs more groups at once (0: that many)"
                    ),
                ));
            }
        }

        let l = &self.launch;
        for (key, n) in [
            ("launch.data_parallel", l.data_parallel),
            ("launch.engines", l.engines),
            ("launch.engine_threads", l.engine_threads),
        ] {
            if n == 0 {
                return Err(err(key, &"must be positive"));
            }
        }
        if let Err(e) = l.sharding.check_served(&self.model.device) {
            return Err(err("launch.sharding", &e));
        }
        if !(l.remote_timeout_s > 0.0 && l.remote_timeout_s.is_finite()) {
            return Err(err("launch.remote_timeout_s", &"must be a positive number of seconds"));
        }
        if let Some(url) = l.remote_engines.iter().find(|u| !u.starts_with("http://")) {
            return Err(err("launch.remote_engines", &format!("`{url}` is not an http:// URL")));
        }
        if self.output.run_dir.as_os_str().is_empty() {
            return Err(err("output.run_dir", &"required"));
        }
        self.tracking.validate(sources)?;
        Ok(())
    }

    /// Keys that do not apply to the chosen mode, set to other than their defaults, are errors
    /// naming them (a saved `config.toml` lists every key at its default, which is fine).
    fn validate_mode_keys(&self, sources: &Sources) -> Result<()> {
        let (a, d) = (&self.async_rl, AsyncSection::default());
        let misapplied: Vec<(&str, &str)> = match self.mode {
            Mode::Sync => [
                ("async_rl.max_staleness", a.max_staleness != d.max_staleness),
                ("async_rl.max_concurrent", a.max_concurrent != d.max_concurrent),
                ("async_rl.weight_update", a.weight_update != d.weight_update),
            ]
            .into_iter()
            .filter(|(_, set)| *set)
            .map(|(key, _)| (key, "applies only to mode = \"async\""))
            .collect(),
            Mode::Async => {
                let mut keys = vec![];
                if self.algorithm.dynamic_sampling == DynamicSampling::Filter {
                    keys.push((
                        "algorithm.dynamic_sampling",
                        "`filter` applies only to mode = \"sync\": in async mode a dropped group is always \
                         replaced by the stream's next one (use `replace`)",
                    ));
                }
                if self.algorithm.max_sampling_rounds != AlgorithmSection::default().max_sampling_rounds {
                    keys.push((
                        "algorithm.max_sampling_rounds",
                        "applies only to mode = \"sync\" (the async stream replaces dropped groups without rounds)",
                    ));
                }
                keys
            }
        };
        match misapplied.first() {
            Some((key, why)) => Err(sources.error(key, why)),
            None => Ok(()),
        }
    }

    /// `[reward]` and `env.python_modules`: what can be checked without starting Python (the
    /// pool checks the rest at start: the function, the classes).
    fn validate_reward(&self, sources: &Sources) -> Result<()> {
        let err = |key: &str, msg: &dyn std::fmt::Display| sources.error(key, msg);
        let r = &self.reward;
        if let Some(f) = r.function() {
            if !std::path::Path::new(&f.path).is_file() {
                return Err(err("reward.custom_function.path", &format!("no file `{}`", f.path)));
            }
            if f.name.is_empty() {
                return Err(err("reward.custom_function.name", &"must not be empty (default compute_score)"));
            }
        }
        if r.workers == 0 {
            return Err(err("reward.workers", &"must be positive"));
        }
        if r.python.is_empty() {
            return Err(err("reward.python", &"must not be empty (default python3)"));
        }
        if !(r.timeout_s.is_finite() && r.timeout_s > 0.0) {
            return Err(err("reward.timeout_s", &"must be positive"));
        }
        if let Some(i) = self.env.python_modules.iter().position(String::is_empty) {
            return Err(err("env.python_modules", &format!("entry {i} is empty")));
        }
        Ok(())
    }

    fn validate_data(&self, sources: &Sources) -> Result<()> {
        let err = |key: &str, msg: &str| sources.error(key, msg);
        let d = &self.data;
        if !crate::env::ENV_NAMES.contains(&d.env.as_str()) {
            return Err(err("data.env", &unknown("env", &d.env, crate::env::ENV_NAMES)));
        }
        if !(0.0..1.0).contains(&d.eval_fraction) {
            return Err(err("data.eval_fraction", "must be in [0, 1)"));
        }
        if d.is_synthetic() {
            if d.synthetic_train == 0 {
                return Err(err("data.synthetic_train", "must be positive (or give data.train_file)"));
            }
            if !(1..=9).contains(&d.synthetic_digits) {
                return Err(err("data.synthetic_digits", "must be between 1 and 9"));
            }
            if d.synthetic_ops.is_empty() || !d.synthetic_ops.chars().all(|c| "+-*".contains(c)) {
                return Err(err("data.synthetic_ops", "must be a non-empty string over `+-*`"));
            }
        }
        Ok(())
    }

    fn validate_algorithm(&self, sources: &Sources) -> Result<()> {
        let err = |key: &str, msg: &dyn std::fmt::Display| sources.error(key, msg);
        let wrap = |key: &str, e: Error| parser_error(sources, key, e);
        let a = &self.algorithm;
        for (key, x) in [("algorithm.gamma", a.gamma), ("algorithm.lambda", a.lambda)] {
            if !(0.0..=1.0).contains(&x) {
                return Err(err(key, &"must be in [0, 1]"));
            }
        }
        self.advantage().map_err(|e| wrap("algorithm.advantage", e))?;

        // The loss: its name, then its config (a bad key there names that key), then the KL term.
        if a.loss == "value" {
            return Err(err("algorithm.loss", &"`value` is the critic's loss, not a policy loss"));
        }
        for key in ["kl_coef", "kl_estimator"] {
            if a.loss_config.contains_key(key) {
                return Err(err(
                    &format!("algorithm.loss_config.{key}"),
                    &"set the KL penalty in [algorithm.kl] (coef, estimator, in_reward)",
                ));
            }
        }
        let kl_term_refused = match self.build_loss(a.kl.coef) {
            Ok(_) => None,
            Err(LossFault::Name(e)) => return Err(wrap("algorithm.loss", e)),
            Err(LossFault::Config(e)) => {
                let key = offending_key(&e, &a.loss_config)
                    .map(|k| format!("algorithm.loss_config.{k}"))
                    .unwrap_or_else(|| "algorithm.loss_config".into());
                return Err(wrap(&key, e));
            }
            Err(LossFault::KlTerm(e)) => Some(e),
        };
        // A bad coefficient is named before a loss that takes no KL term at all.
        if !non_negative(a.kl.coef) {
            return Err(err("algorithm.kl.coef", &"must be non-negative (0 = no KL penalty)"));
        }
        if let Some(e) = kl_term_refused {
            return Err(err(
                "algorithm.kl.coef",
                &format!(
                    "loss `{}` takes no KL term ({}); use a trainer loss such as `regular` or `policy/cispo`, \
                     or set algorithm.kl.in_reward = true",
                    a.loss,
                    match e {
                        Error::Input(m) => m,
                        other => other.to_string(),
                    }
                ),
            ));
        }
        if a.kl.adaptive {
            if a.kl.coef == 0.0 {
                return Err(err("algorithm.kl.adaptive", &"needs algorithm.kl.coef > 0 (the initial coefficient)"));
            }
            AdaptiveKlController::new(a.kl.coef, a.kl.target, a.kl.horizon)
                .map_err(|e| wrap("algorithm.kl.target", e))?;
        }

        let max_seq_len = (a.max_seq_len > 0).then_some(a.max_seq_len);
        LossReduction::of(a.reduction, max_seq_len).map_err(|e| wrap("algorithm.max_seq_len", e))?;

        if let Err(e) = self.off_policy() {
            let key = offending_key(&e, &a.off_policy)
                .map(|k| format!("algorithm.off_policy.{k}"))
                .unwrap_or_else(|| "algorithm.off_policy".into());
            return Err(wrap(&key, e));
        }
        if a.dynamic_sampling == DynamicSampling::Replace && a.max_sampling_rounds == 0 {
            return Err(err("algorithm.max_sampling_rounds", &"must be positive"));
        }
        Ok(())
    }

    /// The resolved config as TOML, for `oxrl config show` and `RUN_DIR/config.toml`.
    pub fn to_toml(&self) -> Result<String> {
        crate::trainer::config_file::to_toml_string(self)
    }

    /// Whether a reference model is needed: a KL penalty (`algorithm.kl.coef > 0`).
    pub fn needs_reference(&self) -> bool {
        self.algorithm.kl.coef > 0.0
    }

    /// Whether a critic is trained: `algorithm.advantage = "gae"`.
    pub fn needs_critic(&self) -> bool {
        self.algorithm.advantage == AdvantageKind::Gae
    }

    /// Sampling parameters of a rollout turn (`eval`: of evaluation): `max_tokens` =
    /// `env.max_turn_tokens`, the temperature, `top_p`, `top_k`; no seed, no stop strings.
    pub fn sampling_params(&self, eval: bool) -> SamplingParams {
        let r = &self.rollout;
        SamplingParams {
            max_tokens: self.env.max_turn_tokens,
            temperature: if eval { r.eval_temperature } else { r.temperature },
            top_k: r.top_k,
            top_p: r.top_p,
            seed: None,
            stop_token_ids: vec![],
            stop_strings: vec![],
            ignore_eos: false,
        }
    }
}

/// A parser's error as an error on config key `key`. Parser errors are `Error::Input(message)`;
/// the message is kept without its prefix.
fn parser_error(sources: &Sources, key: &str, e: Error) -> Error {
    let msg = match e {
        Error::Input(m) => m,
        other => other.to_string(),
    };
    sources.error(key, msg)
}

/// A TOML table as a JSON object (what the algorithm parsers take).
pub fn toml_to_json(table: &toml::Table) -> Json {
    serde_json::to_value(table).unwrap_or(Json::Null)
}

/// The key of `table` that a parser's error message is about: the first one whose name, or
/// whose string value (`unknown truncated IS level `word``), it quotes in backquotes.
fn offending_key(e: &Error, table: &toml::Table) -> Option<String> {
    let msg = e.to_string();
    let at = |text: &str| msg.find(&format!("`{text}`"));
    table
        .iter()
        .filter_map(|(k, v)| {
            let by_value = v.as_str().and_then(at);
            [at(k), by_value].into_iter().flatten().min().map(|pos| (pos, k))
        })
        .min()
        .map(|(_, k)| k.clone())
}

/// Finite and above 0 (false for NaN).
fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Finite and at least 0 (false for NaN).
fn non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}
