//! The sections the SFT and the RL config share: `[model]` (with `[model.lora]`),
//! `[optimizer]`, `[schedule]` and `[output]`, each with its checks, and the `[data]` setting
//! both configs have, `on_bad_row` ([`OnBadRow`]). `[tracking]`, shared too, is
//! [`super::tracking`]'s. The defaults here are SFT's; the RL config ([`super::rl::config`])
//! sets its own for `[schedule]` and `[output]`. The SFT config is [`super::sft::config`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::config_file::Sources;
use crate::error::Result;
use crate::worker::AdamParams;

/// `[model]`: which weights to train and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Hugging Face model directory (config.json, safetensors, tokenizer), or a Hub repo id such
    /// as `Qwen/Qwen3-0.6B`, downloaded into the Hugging Face cache ([`crate::model::hub`]); an
    /// existing directory of that name wins. Default `""`: required.
    pub path: PathBuf,
    /// The Hub revision (branch, tag or commit) of a `path` that is a repo id. Default `""`:
    /// `main`. Ignored for a local directory.
    pub revision: String,
    /// Compute dtype for training: `f32`, `bf16` or `f16`. Default `f32`. With `bf16` / `f16`
    /// the run is mixed precision unless `master_weights = false`.
    pub dtype: String,
    /// For a `bf16` / `f16` `dtype`: keep f32 master weights and f32 AdamW moments, and run
    /// forward/backward in `dtype` on the masters' rounding (mixed precision); checkpoints keep the
    /// masters, the exported model is in `dtype`. `false`: pure half precision, the parameters are
    /// updated in their own dtype (small updates are rounded away). Ignored for `f32`. Default `true`.
    pub master_weights: bool,
    /// Where the model runs, its workers and engines alike: `cpu`, `cuda` or `cuda:N` (CUDA needs
    /// a build with `--features cuda`). Default `cpu`.
    pub device: String,
    /// LoRA adapter; rank 0 (the default) trains every parameter.
    pub lora: LoraSection,
}

impl ModelSection {
    /// `path` made a local directory ([`crate::model::hub::resolve_model_dir`]): a Hub repo id
    /// becomes its snapshot in the Hugging Face cache (downloaded if need be), so the run and its
    /// saved `config.toml` name the directory of the exact commit.
    pub fn resolve(&mut self) -> Result<()> {
        self.path = crate::model::hub::resolve_model_dir(&self.path, &self.revision)?;
        Ok(())
    }

    /// `path` given, a known dtype, a valid LoRA section; errors name the `model.` key.
    pub fn validate(&self, sources: &Sources) -> Result<()> {
        let err = |key: &str, msg: &str| sources.error(key, msg);
        if self.path.as_os_str().is_empty() {
            return Err(err("model.path", "required: the model directory"));
        }
        crate::model::weights::parse_dtype(&self.dtype).map_err(|_| err("model.dtype", "expected f32, bf16 or f16"))?;
        crate::model::weights::check_device_name(&self.device).map_err(|e| err("model.device", &e.to_string()))?;
        let lora = &self.lora;
        if lora.rank > 0 {
            if !(lora.alpha.is_finite() && lora.alpha > 0.0) {
                return Err(err("model.lora.alpha", "must be positive"));
            }
            let targets: Vec<&str> = lora.targets.iter().map(String::as_str).collect();
            crate::model::lora::LoraConfig::new(lora.rank, lora.alpha, &targets)
                .validate()
                .map_err(|e| err("model.lora.targets", &e.to_string()))?;
        }
        Ok(())
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            path: PathBuf::new(),
            revision: String::new(),
            dtype: "f32".into(),
            master_weights: true,
            device: "cpu".into(),
            lora: LoraSection::default(),
        }
    }
}

/// `[model.lora]`: a LoRA adapter on the named projections.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSection {
    /// Adapter rank r. Default 0: no adapter, full fine-tuning.
    pub rank: usize,
    /// Scale numerator: the update is scaled by alpha / r. Default 32.
    pub alpha: f64,
    /// Projections to adapt (`q_proj` … `down_proj`, `lm_head`) or `all-linear`.
    /// Default `["all-linear"]`.
    pub targets: Vec<String>,
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection { rank: 0, alpha: 32.0, targets: vec!["all-linear".into()] }
    }
}

/// What a malformed dataset row does; defined with the row reader ([`crate::rows`]), re-exported
/// here because it is a `[data]` setting of both configs.
pub use crate::rows::OnBadRow;

/// `[optimizer]`: AdamW (decoupled weight decay, bias-corrected).
///
/// Defaults are [`AdamParams::default()`], Tinker's: the same step as a Tinker client's default
/// `AdamParams`, and β2 = 0.95 is the usual choice for LLM training (steadier than Adam's 0.999
/// over short runs). Two departures from Hugging Face's Trainer follow from that table and are
/// worth knowing: no gradient clipping (set `grad_clip_norm = 1.0` for Trainer's), and lr 1e-4
/// suits LoRA; full fine-tuning usually wants about 1e-5.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerSection {
    /// Peak learning rate (after warmup). Default 1e-4.
    pub lr: f64,
    /// Adam β1, β2. Default [0.9, 0.95].
    pub betas: [f64; 2],
    /// Adam ε. Default 1e-12.
    pub eps: f64,
    /// Decoupled weight decay. Default 0.
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 disables clipping. Default 0.
    pub grad_clip_norm: f64,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        let a = AdamParams::default();
        OptimizerSection {
            lr: a.learning_rate,
            betas: [a.beta1, a.beta2],
            eps: a.eps,
            weight_decay: a.weight_decay,
            grad_clip_norm: a.grad_clip_norm,
        }
    }
}

impl OptimizerSection {
    /// Checks the value ranges of `[optimizer]` (the SFT and the RL config share this section
    /// and these checks). Errors name the dotted key (`optimizer.lr`, …) and where its value
    /// came from.
    pub fn validate(&self, sources: &Sources) -> Result<()> {
        let err = |key: &str, msg: &str| sources.error(key, msg);
        if !positive(self.lr) {
            return Err(err("optimizer.lr", "must be positive"));
        }
        if !self.betas.iter().all(|b| (0.0..1.0).contains(b)) {
            return Err(err("optimizer.betas", "each must be in [0, 1)"));
        }
        if !positive(self.eps) {
            return Err(err("optimizer.eps", "must be positive"));
        }
        if !non_negative(self.weight_decay) {
            return Err(err("optimizer.weight_decay", "must be non-negative"));
        }
        if !non_negative(self.grad_clip_norm) {
            return Err(err("optimizer.grad_clip_norm", "must be non-negative (0 disables)"));
        }
        Ok(())
    }

    /// The step's AdamW parameters at learning rate `lr` (the schedule's, not `self.lr`).
    pub fn adam_params(&self, lr: f64) -> AdamParams {
        AdamParams {
            learning_rate: lr,
            beta1: self.betas[0],
            beta2: self.betas[1],
            eps: self.eps,
            weight_decay: self.weight_decay,
            grad_clip_norm: self.grad_clip_norm,
        }
    }
}

/// `[schedule]`: the learning-rate schedule (see [`crate::worker::schedule`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleSection {
    /// `constant`, `linear` (decay to `min_lr_ratio`·lr) or `cosine`. Default `linear`, as
    /// transformers' Trainer.
    pub kind: ScheduleKind,
    /// Steps of linear warmup from 0 to lr. Default 0.
    pub warmup_steps: usize,
    /// The lr at the last step, as a fraction of the peak lr. Default 0.
    pub min_lr_ratio: f64,
}

impl Default for ScheduleSection {
    fn default() -> Self {
        ScheduleSection { kind: ScheduleKind::Linear, warmup_steps: 0, min_lr_ratio: 0.0 }
    }
}

impl ScheduleSection {
    /// Checks the value ranges of `[schedule]` (shared by the SFT and the RL config). Errors
    /// name the dotted key and where its value came from.
    pub fn validate(&self, sources: &Sources) -> Result<()> {
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(sources.error("schedule.min_lr_ratio", "must be in [0, 1]"));
        }
        Ok(())
    }

    /// The schedule of a run of `total_steps` steps.
    pub fn schedule(&self, total_steps: usize) -> crate::worker::LrSchedule {
        crate::worker::LrSchedule {
            kind: self.kind,
            warmup_steps: self.warmup_steps,
            total_steps,
            min_lr_ratio: self.min_lr_ratio,
        }
    }
}

pub use crate::worker::schedule::ScheduleKind;

/// `[output]`: where the run writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutputSection {
    /// Run directory: `config.toml` (resolved), `metrics.jsonl`, `loss.png`, checkpoints.
    /// Default `runs/sft`.
    pub run_dir: PathBuf,
}

impl Default for OutputSection {
    fn default() -> Self {
        OutputSection { run_dir: PathBuf::from("runs/sft") }
    }
}

/// Finite and above 0 (false for NaN).
fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Finite and at least 0 (false for NaN).
fn non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}
