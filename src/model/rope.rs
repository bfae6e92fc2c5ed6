//! Rotary position embeddings, in the "rotate half" layout of Hugging Face transformers.
//!
//! For a head vector x = [x1, x2] (two halves of length d/2) at position p:
//!   rope(x) = [x1·cos − x2·sin, x2·cos + x1·sin],  angle_i = p · inv_freq_i,
//!   inv_freq_i = theta^(−2i/d), optionally rescaled (linear, or Llama 3's piecewise rule).
//! This file holds the tables; the rotation is [`super::ops::rope`] (fused, and its candle
//! reference). Tables are computed in f64 and stored in f32 (transformers computes them in f32; the
//! difference is far below the 1e-4 tolerance against it).

use candle_core::{DType, Device, Tensor};

use super::model_config::{ModelConfig, RopeScaling};
use crate::{Error, Result};

/// cos/sin tables of shape [max_position_embeddings, rotary_dim / 2] (rotary_dim = head_dim but
/// for a partial rotary factor, whose frequencies are those of a head of rotary_dim).
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    max_positions: usize,
}

pub fn inverse_frequencies(cfg: &ModelConfig) -> Vec<f64> {
    let d = cfg.rotary_dim;
    let base: Vec<f64> = (0..d / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64)).collect();
    match cfg.rope_scaling {
        RopeScaling::None | RopeScaling::Linear { .. } => base,
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|freq| {
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen < high_wavelen {
                        freq
                    } else if wavelen > low_wavelen {
                        freq / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                })
                .collect()
        }
    }
}

impl Rope {
    pub fn new(cfg: &ModelConfig, device: &Device) -> Result<Self> {
        let inv_freq = inverse_frequencies(cfg);
        let pos_scale = match cfg.rope_scaling {
            RopeScaling::Linear { factor } => 1.0 / factor,
            _ => 1.0,
        };
        let n = cfg.max_position_embeddings;
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in 0..n {
            for &f in &inv_freq {
                let angle = p as f64 * pos_scale * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Ok(Rope {
            cos: Tensor::from_vec(cos, (n, half), device)?,
            sin: Tensor::from_vec(sin, (n, half), device)?,
            max_positions: n,
        })
    }

    /// cos and sin for `positions` (B rows of T), each [B, 1, T, rotary_dim/2] in `dtype`.
    pub fn tables(&self, positions: &[Vec<u32>], dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, t) = (positions.len(), positions.first().map_or(0, Vec::len));
        // Checked on the host, where the positions are: no device round trip per forward.
        let max = positions.iter().flatten().copied().max().unwrap_or(0) as usize;
        if max >= self.max_positions {
            return Err(Error::input(format!(
                "position {max} is beyond max_position_embeddings = {} of the model config",
                self.max_positions
            )));
        }
        let flat = Tensor::from_vec(positions.concat(), b * t, self.cos.device())?;
        let gather = |table: &Tensor| -> Result<Tensor> {
            Ok(table.index_select(&flat, 0)?.reshape((b, 1, t, ()))?.to_dtype(dtype)?)
        };
        Ok((gather(&self.cos)?, gather(&self.sin)?))
    }
}
