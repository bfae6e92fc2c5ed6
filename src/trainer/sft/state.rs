//! SFT's part of a checkpoint's `trainer_state.json`, beside the step: its data loader's
//! position and every evaluation's loss. The JSON keys are those every SFT checkpoint has had
//! (`loader`, `evals`; older ones also hold an unused `kl_coef`, ignored), so they resume.

use serde::{Deserialize, Serialize};

use crate::trainer::data_loader::LoaderPosition;

/// SFT's state in a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SftState {
    /// Where the run is in its data.
    pub loader: LoaderPosition,
    /// Every evaluation so far: (step, [eval loss]).
    #[serde(default)]
    pub evals: Vec<(usize, Vec<f64>)>,
}
