//! The critic's value head: a linear map from the final hidden state to one value per token.
//!
//! `v_t = h_t · wᵀ + b` with `value_head.weight` [1, hidden] and `value_head.bias` \[1\], both
//! trainable. Fresh heads start as PyTorch's `nn.Linear`'s weight, `w ~ U(±1/√hidden)`, and
//! `b = 0` (a zero weight would stop the gradient from reaching the body at step 0).

use candle_core::{DType, Device, Tensor, Var};
use rand::rngs::StdRng;

use crate::model::init::uniform;
use crate::model::linear::Linear;
use crate::Result;

pub const WEIGHT: &str = "value_head.weight";
pub const BIAS: &str = "value_head.bias";

#[derive(Clone, Debug)]
pub struct ValueHead {
    pub weight: Var,
    pub bias: Var,
}

impl ValueHead {
    pub fn new(rng: &mut StdRng, hidden: usize, dtype: DType, device: &Device) -> Result<Self> {
        let w = uniform(rng, &[1, hidden], 1.0 / (hidden as f64).sqrt(), dtype, device)?;
        Ok(ValueHead { weight: Var::from_tensor(&w)?, bias: Var::zeros(1, dtype, device)? })
    }

    /// Values \[N\] for hidden states [N, hidden].
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let linear = Linear::new(self.weight.as_tensor().clone(), Some(self.bias.as_tensor().clone()));
        Ok(linear.forward(hidden)?.squeeze(1)?)
    }

    /// The head's variables by name.
    pub fn vars(&self) -> Vec<(String, Var)> {
        vec![(WEIGHT.to_string(), self.weight.clone()), (BIAS.to_string(), self.bias.clone())]
    }
}
