//! `[tracking]`: where a run's metrics go besides `metrics.jsonl` (the one section the SFT and
//! the RL config share for it), and its checks.

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::trainer::config_file::Sources;

crate::choice! {
    /// Where a run's metrics lines go.
    pub enum Backend("tracking backend") {
        /// `RUN_DIR/metrics.jsonl`: what `--resume` and the plots read, so always on.
        Jsonl = "jsonl",
        /// TensorBoard event files under `RUN_DIR/tensorboard/`, written by oxrl.
        Tensorboard = "tensorboard",
        /// Weights & Biases, through a Python worker process running `wandb`.
        Wandb = "wandb",
    }
}

/// `[tracking]`: experiment tracking backends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrackingSection {
    /// Where each metrics line goes: `jsonl` (required: `metrics.jsonl` is what `--resume` and
    /// the plots read), `tensorboard` (`RUN_DIR/tensorboard/`), `wandb` (Weights & Biases,
    /// honouring `WANDB_MODE`, `WANDB_API_KEY`, … from the environment). Default `["jsonl"]`.
    pub backends: Vec<Backend>,
    /// W&B project. Default `oxrl`.
    pub project: String,
    /// W&B run name. Default `""`: the run directory's name.
    pub run_name: String,
    /// The Python interpreter that runs the W&B worker (it must import `wandb`): a name looked
    /// up in `PATH` or a path. Default `python3`.
    pub python: String,
}

impl Default for TrackingSection {
    fn default() -> Self {
        TrackingSection {
            backends: vec![Backend::Jsonl],
            project: "oxrl".into(),
            run_name: String::new(),
            python: "python3".into(),
        }
    }
}

impl TrackingSection {
    /// Whether `backend` is on.
    pub fn has(&self, backend: Backend) -> bool {
        self.backends.contains(&backend)
    }

    /// `jsonl` listed, no backend twice, a project and an interpreter for `wandb`. Errors name
    /// the `tracking.` key and where its value came from. (Unknown names are refused when the
    /// config is read, with the nearest valid one.)
    pub fn validate(&self, sources: &Sources) -> Result<()> {
        let err = |key: &str, msg: &str| sources.error(key, msg);
        if !self.has(Backend::Jsonl) {
            return Err(err(
                "tracking.backends",
                "must include \"jsonl\": metrics.jsonl is what --resume and the plots read \
                 (list tensorboard / wandb beside it)",
            ));
        }
        for (i, b) in self.backends.iter().enumerate() {
            if self.backends[..i].contains(b) {
                return Err(err("tracking.backends", &format!("\"{b}\" is listed twice")));
            }
        }
        if self.has(Backend::Wandb) {
            if self.project.trim().is_empty() {
                return Err(err("tracking.project", "must not be empty (the W&B project)"));
            }
            if self.python.trim().is_empty() {
                return Err(err("tracking.python", "must not be empty (the interpreter of the W&B worker)"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_checks() {
        let d = TrackingSection::default();
        assert_eq!(d.backends, vec![Backend::Jsonl]);
        assert_eq!((d.project.as_str(), d.run_name.as_str(), d.python.as_str()), ("oxrl", "", "python3"));
        d.validate(&Sources::none()).unwrap();

        let with = |backends: Vec<Backend>| TrackingSection { backends, ..TrackingSection::default() };
        let e = with(vec![Backend::Wandb]).validate(&Sources::none()).unwrap_err().to_string();
        assert!(e.contains("`tracking.backends`: must include \"jsonl\""), "{e}");
        let e = with(vec![Backend::Jsonl, Backend::Tensorboard, Backend::Tensorboard])
            .validate(&Sources::none())
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("\"tensorboard\" is listed twice"), "{e}");
        let e = TrackingSection { python: " ".into(), ..with(vec![Backend::Jsonl, Backend::Wandb]) }
            .validate(&Sources::none())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`tracking.python`"), "{e}");
        // Without wandb its keys are not used, so not checked.
        TrackingSection { python: String::new(), ..with(vec![Backend::Jsonl, Backend::Tensorboard]) }
            .validate(&Sources::none())
            .unwrap();
    }
}
