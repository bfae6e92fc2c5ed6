//! A linear projection `y = x·Wᵀ + b`, optionally with a LoRA adapter `+ s·(x·Aᵀ)·Bᵀ`.
//!
//! W has the PyTorch layout [out, in]. The input is flattened to 2-D so that one matmul serves
//! any batch shape. The adapter's scale s is alpha/r (or alpha/√r for rsLoRA); dropout on the
//! adapter input is not applied (LoRA dropout is a regulariser we leave out for now).

use candle_core::Tensor;

use crate::Result;

#[derive(Debug, Clone)]
pub struct LoraPair {
    /// [r, in]
    pub a: Tensor,
    /// [out, r]
    pub b: Tensor,
    pub scale: f64,
}

/// `t` itself, or when it belongs to an autograd graph (a variable, or computed from one) a copy
/// in storage of its own, detached: a tensor that in-place optimizer steps cannot reach and that
/// builds no graph.
pub(crate) fn owned(t: &Tensor) -> Result<Tensor> {
    Ok(if t.track_op() { t.copy()?.detach() } else { t.clone() })
}

impl LoraPair {
    /// The pair with A and B [`owned`].
    pub fn owned(&self) -> Result<LoraPair> {
        Ok(LoraPair { a: owned(&self.a)?, b: owned(&self.b)?, scale: self.scale })
    }

    /// (s·(x·Aᵀ))·Bᵀ for x [..., in]: [..., out]. The scale goes on the rank-r product, before
    /// Bᵀ, as in the trainer's forward (`model::tape::linear`), so that both give the same bits.
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let mut dims = x.dims().to_vec();
        let in_dim = *dims.last().expect("linear input has at least one dimension");
        let su = (super::ops::matmul_wt::matmul_wt(&x.reshape(((), in_dim))?, &self.a)? * self.scale)?;
        let d = super::ops::matmul_wt::matmul_wt(&su, &self.b)?;
        *dims.last_mut().unwrap() = self.b.dim(0)?;
        Ok(d.reshape(dims)?)
    }
}

#[derive(Debug, Clone)]
pub struct Linear {
    /// [out, in]
    pub weight: Tensor,
    /// [out]
    pub bias: Option<Tensor>,
    pub lora: Option<LoraPair>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias, lora: None }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let in_dim = *dims.last().expect("linear input has at least one dimension");
        let x2 = x.reshape(((), in_dim))?;
        let mut y = super::ops::matmul_wt::matmul_wt(&x2, &self.weight)?;
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        if let Some(l) = &self.lora {
            y = (y + l.delta(&x2)?)?;
        }
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.weight.dim(0)?;
        Ok(y.reshape(out_dims)?)
    }

    /// W + s·B·A: the adapter folded into the base weight, for export.
    pub fn merged_weight(&self) -> Result<Tensor> {
        match &self.lora {
            None => Ok(self.weight.clone()),
            Some(l) => {
                let dt = self.weight.dtype();
                let delta =
                    (l.b.to_dtype(candle_core::DType::F32)?.matmul(&l.a.to_dtype(candle_core::DType::F32)?)?
                        * l.scale)?;
                Ok((self.weight.to_dtype(candle_core::DType::F32)? + delta)?.to_dtype(dt)?)
            }
        }
    }
}
