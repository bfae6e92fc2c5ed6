//! RL's part of a checkpoint's `trainer_state.json`, beside the step: where the run is in its
//! prompts (a data loader's position in sync mode; the prompt stream and its staleness counters
//! in async mode), the KL controller's coefficient, and every evaluation's pass@1 and pass@n.
//! The JSON keys are those every RL checkpoint has had (`loader` or `stream`, `kl_coef`,
//! `evals`), so older checkpoints resume.

use serde::{Deserialize, Serialize};

use super::prompt_stream::StreamState;
use super::staleness::Staleness;
use crate::trainer::data_loader::LoaderPosition;
use crate::trainer::run_dir::TrainerState;
use crate::{Error, Result};

/// RL's state in a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RlState {
    /// Where the run is in its data.
    #[serde(flatten)]
    pub data: DataPosition,
    /// The KL controller's coefficient.
    #[serde(default)]
    pub kl_coef: f64,
    /// Every evaluation so far: (step, \[pass@1, pass@n\]).
    #[serde(default)]
    pub evals: Vec<(usize, Vec<f64>)>,
}

/// Where a run is in its data: a loader position (sync RL), or the async trainer's prompt
/// stream and staleness counters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataPosition {
    Loader(LoaderPosition),
    Stream(StreamPosition),
}

/// The async trainer's data position: consumed, filtered and pending groups, and the staleness
/// control it ran under (its `max_staleness` is checked against the config on resume).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamPosition {
    #[serde(flatten)]
    pub stream: StreamState,
    pub staleness: Staleness,
}

impl DataPosition {
    /// The trainer that writes this kind of position, for errors.
    fn made_by(&self) -> &'static str {
        match self {
            DataPosition::Loader(_) => "a data loader's (SFT, or RL with mode = \"sync\")",
            DataPosition::Stream(_) => "mode = \"async\"",
        }
    }
}

/// The data position of a resumed run, checked to be of the kind this mode writes.
pub fn expect_position(state: &TrainerState<RlState>, stream: bool) -> Result<&DataPosition> {
    let data = &state.trainer.data;
    let ok = matches!((data, stream), (DataPosition::Loader(_), false) | (DataPosition::Stream(_), true));
    if !ok {
        return Err(Error::input(format!(
            "the checkpoint at step {} is {} run's: resume it in that mode",
            state.step,
            data.made_by()
        )));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `trainer_state.json` of a sync and an async RL run written by `oxrl rl` on 2026-11-26, before
    /// RL kept its own part of it: read as RL's state and written again, byte for byte.
    #[test]
    fn rl_checkpoints_written_before_read_and_write_back_the_same() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoints");
        for (file, stream) in [("rl_sync_trainer_state.json", false), ("rl_async_trainer_state.json", true)] {
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            let state: TrainerState<RlState> = serde_json::from_str(&text).unwrap();
            assert_eq!((state.step, state.trainer.kl_coef, state.trainer.evals.len()), (3, 0.05, 2), "{file}");
            assert!(expect_position(&state, stream).is_ok(), "{file}");
            let e = expect_position(&state, !stream).unwrap_err().to_string();
            assert!(e.contains("resume it in that mode"), "{e}");
            let again = serde_json::to_string_pretty(&serde_json::to_value(&state).unwrap()).unwrap() + "\n";
            assert_eq!(again, text, "{file}");
        }
    }
}
