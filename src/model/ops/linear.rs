//! A projection y = x · Wᵀ as one node of candle's graph: x [..., in], W [out, in], y [..., out].
//!
//! `Linear::forward` on candle's primitives is a chain: x reshaped to rows, the product with W's
//! transpose, the result reshaped back. candle's backward adds each edge's gradient into a
//! fresh zero-filled buffer, so every projection of a step paid passes over its input and its
//! output (the MLP's are the size of the intermediate activations) beyond the products
//! themselves. As one node, only x and W receive a gradient.
//!
//! Forward: the chain's operations on detached inputs. Backward, from dy (rows: `2`):
//! ```text
//! dx = (dy₂ · W) reshaped as x,     dW = (x₂ᵀ · dy₂)ᵀ
//! ```
//! the chain's backward operation by operation (candle's matmul backward; the transpose's
//! gradient stored contiguous): each gradient is the chain's bits. (Where x feeds several
//! projections, candle adds their parts in its own order, as it did before.)

use candle_core::{CustomOp2, Tensor};

use super::matmul::matmul;
use super::node_output::{forward_from_out, NodeOutput};
use super::transpose::transposed;
use crate::{Error, Result};

/// x [..., in] · Wᵀ for W [out, in], as one node when an input tracks a gradient (else the
/// product itself).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (out, inp) = w.dims2()?;
    if dims.last() != Some(&inp) || w.dtype() != x.dtype() {
        return Err(Error::input(format!(
            "linear: x {:?} ({:?}) and W {:?} ({:?})",
            dims,
            x.dtype(),
            w.dims(),
            w.dtype()
        )));
    }
    let mut out_dims = dims;
    *out_dims.last_mut().expect("x has a last dimension") = out;
    let y = matmul(&x.detach().reshape(((), inp))?, &w.detach().t()?)?.reshape(out_dims)?;
    if !(x.track_op() || w.track_op()) {
        return Ok(y);
    }
    Ok(x.apply_op2(w, LinearNode { out: NodeOutput::new("linear", y) })?)
}

/// The graph node: its output, computed before the node exists.
struct LinearNode {
    out: NodeOutput,
}

impl CustomOp2 for LinearNode {
    fn name(&self) -> &'static str {
        "linear"
    }

    forward_from_out!(s1 l1, s2 l2);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let m = |e: Error| candle_core::Error::Msg(e.to_string());
        let (out, inp) = w.dims2()?;
        let dy = grad.contiguous()?.reshape(((), out))?;
        let x2 = x.reshape(((), inp))?;
        let wt = w.t()?;
        let dx = matmul(&dy, &wt.t()?).map_err(m)?.reshape(x.dims())?;
        let dw = transposed(&matmul(&x2.t()?, &dy).map_err(m)?).map_err(m)?;
        Ok((Some(dx), Some(dw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::bits;
    use candle_core::{DType, Device, Var};

    fn var(shape: &[usize], seed: u64, dtype: DType) -> Var {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|i| ((i as f64 + seed as f64 * 0.37) * 0.731).sin()).collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap()
    }

    /// One node gives the chain's values and gradients to the bit, in f32 and f64, from a
    /// batch of rows [B, T, in].
    #[test]
    fn one_node_gives_the_chains_bits() {
        for dtype in [DType::F32, DType::F64] {
            let (x, w, c) = (var(&[2, 3, 5], 1, dtype), var(&[7, 5], 2, dtype), var(&[2, 3, 7], 3, dtype));
            let run = |y: Tensor| {
                let grads = (y * c.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
                (bits(grads.get(x.as_tensor()).unwrap()), bits(grads.get(w.as_tensor()).unwrap()))
            };
            let y = linear(x.as_tensor(), w.as_tensor()).unwrap();
            let chain = matmul(&x.as_tensor().reshape(((), 5)).unwrap(), &w.as_tensor().t().unwrap())
                .unwrap()
                .reshape((2, 3, 7))
                .unwrap();
            assert_eq!(bits(&y), bits(&chain), "{dtype:?}: values");
            assert_eq!(run(y), run(chain), "{dtype:?}: gradients");
        }
    }

    #[test]
    fn mismatched_shapes_are_errors() {
        let (x, w) = (var(&[3, 4], 1, DType::F32), var(&[9, 5], 2, DType::F32));
        assert!(linear(x.as_tensor(), w.as_tensor()).is_err());
    }
}
