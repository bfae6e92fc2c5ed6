//! A linear projection `y = x·Wᵀ + b`, optionally with a LoRA adapter `+ s·(x·Aᵀ)·Bᵀ`.
//!
//! W has the PyTorch layout [out, in]. The input is flattened to 2-D so that one matmul serves
//! any batch shape. The adapter's scale s is alpha/r (or alpha/√r for rsLoRA); dropout on the
//! adapter input is not applied (LoRA dropout is a regulariser we leave out for now).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor, TensorId};

use super::ops::matmul_wt::{self, Packed};

use crate::locks::lock;
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
    /// The pair with A and B `owned`.
    pub fn owned(&self) -> Result<LoraPair> {
        Ok(LoraPair { a: owned(&self.a)?, b: owned(&self.b)?, scale: self.scale })
    }

    /// (s·(x·Aᵀ))·Bᵀ for x [..., in]: [..., out]. The scale goes on the rank-r product, before
    /// Bᵀ, as in the trainer's forward (`model::tape::linear`), so that both give the same bits.
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let mut dims = x.dims().to_vec();
        let in_dim = *dims.last().expect("linear input has at least one dimension");
        let (a, b) = (Linear::as_dtype(&self.a, x.dtype())?, Linear::as_dtype(&self.b, x.dtype())?);
        let su = (matmul_wt::matmul_wt(&x.reshape(((), in_dim))?, &a)? * self.scale)?;
        let d = matmul_wt::matmul_wt(&su, &b)?;
        *dims.last_mut().unwrap() = self.b.dim(0)?;
        Ok(d.reshape(dims)?)
    }
}

#[derive(Debug, Clone)]
pub struct Linear {
    /// [out, in]
    pub weight: Tensor,
    /// \[out\]
    pub bias: Option<Tensor>,
    pub lora: Option<LoraPair>,
    /// The weight packed for inference, made at first use and kept while the weight is the same
    /// tensor (shared by clones; see [`Linear::packed`]).
    packed: PackedWeight,
}

/// (the weight tensor it was packed from, the packing).
type PackedWeight = Arc<Mutex<Option<(TensorId, Arc<Packed>)>>>;

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias, lora: None, packed: PackedWeight::default() }
    }

    /// The weight packed for [`matmul_wt::matmul_wt_packed`], for an inference forward in f32:
    /// packed once per weight tensor (an engine's weights are immutable tensors, replaced whole
    /// by an update, so a new tensor id means new weights). None for a trained
    /// variable (changed in place by the optimizer), and for weights not f32 or bf16 on the CPU.
    fn packed(&self, x: &Tensor) -> Result<Option<Arc<Packed>>> {
        let w = &self.weight;
        let serves = x.dtype() == DType::F32
            && w.device().is_cpu()
            && matches!(w.dtype(), DType::F32 | DType::BF16)
            && !w.is_variable()
            && !w.track_op()
            && w.rank() == 2;
        if !serves {
            return Ok(None);
        }
        let mut slot = lock(&self.packed);
        if let Some((id, p)) = slot.as_ref() {
            if *id == w.id() {
                return Ok(Some(p.clone()));
            }
        }
        let (n, k) = w.dims2()?;
        let flat = w.contiguous()?.flatten_all()?;
        let p = Arc::new(match w.dtype() {
            DType::BF16 => {
                let bits: Vec<u16> = flat.to_vec1::<half::bf16>()?.into_iter().map(half::bf16::to_bits).collect();
                Packed::new_bf16(&bits, n, k)
            }
            _ => Packed::new(&flat.to_vec1::<f32>()?, n, k),
        });
        *slot = Some((w.id(), p.clone()));
        Ok(Some(p))
    }

    /// `t` in `dtype` (itself when it is already): a bf16 model computes in f32 on the CPU (see
    /// [`super::transformer::Transformer::compute_dtype`]), its weights widened as they are read.
    fn as_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
        Ok(if t.dtype() == dtype { t.clone() } else { t.to_dtype(dtype)? })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // On a GPU a differentiated product without an adapter is one graph node (ops::linear:
        // no edge for the reshapes and the weight's transpose).
        if self.lora.is_none() && x.device().is_cuda() && (x.track_op() || self.weight.track_op()) {
            let y = super::ops::linear::linear(x, &Self::as_dtype(&self.weight, x.dtype())?)?;
            return match &self.bias {
                Some(b) => Ok(y.broadcast_add(&Self::as_dtype(b, y.dtype())?)?),
                None => Ok(y),
            };
        }
        let dims = x.dims().to_vec();
        let in_dim = *dims.last().expect("linear input has at least one dimension");
        let x2 = x.reshape(((), in_dim))?;
        let mut y = self.product_rows(&x2)?;
        if let Some(b) = &self.bias {
            y = super::ops::add::bias_add(&y, &Self::as_dtype(b, y.dtype())?)?;
        }
        if let Some(l) = &self.lora {
            y = (y + l.delta(&x2)?)?;
        }
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.weight.dim(0)?;
        Ok(y.reshape(out_dims)?)
    }

    /// x·Wᵀ for rows x2 [N, in] (the product [`Linear::forward`] adds the bias and the adapter to).
    fn product_rows(&self, x2: &Tensor) -> Result<Tensor> {
        let packed = match self.packed(x2)? {
            Some(p) => matmul_wt::matmul_wt_packed(x2, &p)?,
            None => None,
        };
        Ok(match packed {
            Some(y) => y,
            None => matmul_wt::matmul_wt(x2, &Self::as_dtype(&self.weight, x2.dtype())?)?,
        })
    }

    /// x·Wᵀ without the bias, for a layer without an adapter whose next op adds the bias itself
    /// (`ops::rope::rope_pair`); an error with an adapter, whose delta comes after the bias.
    pub(crate) fn product(&self, x: &Tensor) -> Result<Tensor> {
        if self.lora.is_some() {
            return Err(crate::Error::Other("Linear::product: a layer with an adapter".into()));
        }
        let mut dims = x.dims().to_vec();
        let in_dim = *dims.last().expect("linear input has at least one dimension");
        let y = self.product_rows(&x.reshape(((), in_dim))?)?;
        *dims.last_mut().unwrap() = self.weight.dim(0)?;
        Ok(y.reshape(dims)?)
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
