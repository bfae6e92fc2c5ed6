//! The LM head and the target log-probs as one node of candle's graph: (log p(y), lse) [N, 2]
//! from hidden states h [N, H] and the head's weight W [V, H], through the logits z = h Wᵀ
//! [N, V], which no other node sees.
//!
//! The chain it replaces (a matmul, the transpose of W, a cast of z to f32, the fused
//! log-prob op) holds [N, V] tensors at each edge, and candle's backward adds each edge's
//! gradient into a fresh zero-filled buffer: passes over the largest tensors of a step. On
//! CUDA in bf16/f16 the log-prob op's mixed kernels also read z in its dtype and write dz in it
//! (the f32 kernels' values on the cast, without the casts).
//!
//! Forward: z = h · Wᵀ on detached inputs, the fused op's (lp, lse); z is kept. Backward, from
//! the output gradients g [N, 2]:
//! ```text
//! dz = p · (g_lse − g_lp) + g_lp · onehot(y),  p = exp(z − lse)   (the fused op's backward)
//! dh = dz · W,    dW = (hᵀ · dz)ᵀ
//! ```
//! the chain's backward operation by operation (candle's matmul backward, the transpose's
//! gradient stored contiguous): its bits. At a temperature T the log-probs are those of
//! z · (1/T) (the chain with the f32 logits scaled after the cast, its gradient times 1/T):
//! the mixed kernels scale as they read, the f32 path scales z in a pass of its own.

use candle_core::{CustomOp2, DType, Tensor, D};

use super::matmul::matmul;
use super::node_output::{forward_from_out, NodeOutput};
use super::transpose::transposed;
use super::{cuda_kernels, logprob_lse, norm_dtype};
use crate::{Error, Result};

/// Whether [`head_logprobs`] serves hidden states of `dtype` on `device`: the fused log-prob
/// op's devices (CUDA with oxrl's kernels; the CPU in f32/f64).
pub fn serves(device: &candle_core::Device, dtype: DType) -> bool {
    match device {
        candle_core::Device::Cpu => matches!(dtype, DType::F32 | DType::F64),
        candle_core::Device::Cuda(_) => cuda_kernels() && matches!(dtype, DType::F32 | DType::BF16 | DType::F16),
        _ => false,
    }
}

/// (log p(targets) of shape \[N\], logsumexp of shape \[N, 1\]), in f32 (f64 for f64), from
/// hidden states \[N, H\], the head's weight \[V, H\] (of the hidden states' dtype) and u32
/// targets \[N\], of softmax(logits · `inv_temperature`). Call where [`serves`] says.
pub fn head_logprobs(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    inv_temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let dtype = hidden.dtype();
    if !serves(hidden.device(), dtype) || weight.dtype() != dtype {
        return Err(Error::input(format!(
            "head log-probs: hidden states {dtype:?} and weight {:?} on {:?} are not served",
            weight.dtype(),
            hidden.device()
        )));
    }
    let (n, h) = hidden.dims2()?;
    if weight.dim(1)? != h || targets.dims() != [n] {
        return Err(Error::input(format!(
            "head log-probs: hidden {:?}, weight {:?}, targets {:?}",
            hidden.dims(),
            weight.dims(),
            targets.dims()
        )));
    }
    let mixed = norm_dtype(dtype) != dtype;
    if !(inv_temperature.is_finite() && inv_temperature > 0.0) {
        return Err(Error::input(format!("head log-probs: 1 / temperature {inv_temperature}")));
    }
    let mut z = matmul(&hidden.detach(), &weight.detach().t()?)?;
    let targets = targets.contiguous()?;
    let out = match mixed {
        true => logprob_lse::forward_mixed(&z, &targets, inv_temperature as f32)?,
        false => {
            if inv_temperature != 1.0 {
                z = (z * inv_temperature)?;
            }
            logprob_lse::forward_no_grad(&z, &targets)?
        }
    };
    let node = HeadNode { out: NodeOutput::new("head log-probs", out), logits: z, targets, mixed, inv_temperature };
    let out = hidden.apply_op2(weight, node)?;
    Ok((out.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?, out.narrow(D::Minus1, 1, 1)?))
}

/// The graph node: its output (computed before the node exists) and what the backward reads.
struct HeadNode {
    out: NodeOutput,
    /// z [N, V] in the hidden states' dtype (scaled by `inv_temperature` unless `mixed`).
    logits: Tensor,
    targets: Tensor,
    /// bf16/f16 logits: the log-prob op's mixed kernels.
    mixed: bool,
    inv_temperature: f64,
}

impl CustomOp2 for HeadNode {
    fn name(&self) -> &'static str {
        "head-logprobs"
    }

    forward_from_out!(s1 l1, s2 l2);

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let m = |e: Error| candle_core::Error::Msg(e.to_string());
        let rg = Tensor::cat(&[&out.contiguous()?, &grad.contiguous()?], D::Minus1)?;
        let s = self.inv_temperature;
        let dz = match self.mixed {
            true => logprob_lse::backward_mixed(&self.logits, &self.targets, &rg, s as f32).map_err(m)?,
            false if s != 1.0 => (logprob_lse::backward(&self.logits, &self.targets, &rg)? * s)?,
            false => logprob_lse::backward(&self.logits, &self.targets, &rg)?,
        };
        let wt = weight.t()?;
        let dh = matmul(&dz, &wt.t()?).map_err(m)?;
        let dw = transposed(&matmul(&hidden.t()?, &dz).map_err(m)?).map_err(m)?;
        Ok((Some(dh), Some(dw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::bits;
    use candle_core::{Device, Var};

    fn var(shape: &[usize], seed: u64, dtype: DType) -> Var {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|i| ((i as f64 + seed as f64 * 0.37) * 0.731).sin()).collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap()
    }

    /// One node gives the chain's values and gradients to the bit (both outputs carrying a
    /// gradient), in f32 and f64, at temperature 1 and at 0.7 (the chain's logits scaled).
    #[test]
    fn one_node_gives_the_chains_bits() {
        for dtype in [DType::F32, DType::F64] {
            let (n, h, v) = (7, 5, 23);
            let (x, w) = (var(&[n, h], 1, dtype), var(&[v, h], 2, dtype));
            let targets = Tensor::from_vec((0..n as u32).map(|i| i * 5 % v as u32).collect(), n, &Device::Cpu).unwrap();
            let (a, b) = (var(&[n], 3, dtype), var(&[n, 1], 4, dtype));
            let run = |(lp, lse): (Tensor, Tensor)| {
                let loss = ((lp * a.as_tensor()).unwrap().sum_all().unwrap()
                    + (lse * b.as_tensor()).unwrap().sum_all().unwrap())
                .unwrap();
                let grads = loss.backward().unwrap();
                (bits(&loss), bits(grads.get(x.as_tensor()).unwrap()), bits(grads.get(w.as_tensor()).unwrap()))
            };
            for s in [1.0, 1.0 / 0.7] {
                let node = run(head_logprobs(x.as_tensor(), w.as_tensor(), &targets, s).unwrap());
                let logits = matmul(x.as_tensor(), &w.as_tensor().t().unwrap()).unwrap();
                let logits = if s == 1.0 { logits } else { (logits * s).unwrap() };
                let chain = run(logprob_lse::forward(&logits, &targets).unwrap());
                assert_eq!(node, chain, "{dtype:?}, 1/T = {s}");
            }
        }
    }

    #[test]
    fn mismatched_shapes_are_errors() {
        let (x, w) = (var(&[3, 4], 1, DType::F32), var(&[9, 5], 2, DType::F32));
        let y = Tensor::new(&[0u32, 1, 2], &Device::Cpu).unwrap();
        assert!(head_logprobs(x.as_tensor(), w.as_tensor(), &y, 1.0).is_err());
    }
}
