//! Attention as one node of candle's graph, its backward written out: out = softmax(scale · q kᵀ
//! + bias) v as [B, T, H·D], for q [B, H, T, D], k and v [B, KV, S, D].
//!
//! The reference ([`super::cached_attention::reference`]) is a chain of a dozen nodes: a matmul,
//! reshapes, casts to and from f32 around the fused softmax, a transpose. candle's backward adds
//! each node's gradient into a fresh zero-filled buffer, a pass over a [B, H, T, S] tensor per
//! edge, several per layer. As one node, only q, k and v receive a gradient.
//!
//! Forward: the reference's operations on detached inputs; the softmax's probabilities P (f32
//! for bf16/f16 inputs) and P in the inputs' dtype are kept for the backward. On CUDA in
//! bf16/f16 the softmax's mixed kernels read the scores and write P in that dtype and each
//! row's max and sum; the backward's kernel computes the f32 P again from the scores (kept
//! instead of it: half the bytes) and writes the gradient in that dtype: the f32 kernels'
//! values on the casts, without the casts' passes. Backward, with the `rep` query heads that
//! share a kv head folded into the rows of one batched product as the forward does (′ marks
//! that layout, dO the output's gradient):
//! ```text
//! dO′ = dO as [B, KV, REP·T, D]
//! dP′ = dO′ · vᵀ,    dv = P′ᵀ · dO′        (P′ = P in the inputs' dtype)
//! dS  = scale · P ⊙ (dP − Σ_s P ⊙ dP)     (the fused softmax's backward, in P's dtype)
//! dq′ = dS′ · k,     dk = (q′ᵀ · dS′)ᵀ
//! ```
//! These are the operations candle's backward of the reference runs, in its order, on the
//! layouts it stores (every gradient it keeps is contiguous): the gradients are the
//! reference's bits. Where the fused softmax does not run (CUDA with oxrl's kernels off), and
//! where no input tracks a gradient, the reference runs itself. Where flash attention serves
//! (CUDA, bf16/f16, head dimension 64 or 128: [`flash_attention::serves`]) it runs instead,
//! tracked or not: the scores never in memory, not these bits.

use candle_core::{CustomOp3, DType, Device, Tensor};

use super::matmul::matmul;
use super::node_output::{forward_from_out, NodeOutput};
use super::transpose::{heads_swapped, transposed};
use super::{cached_attention, cuda_kernels, flash_attention, norm_dtype, softmax};
use crate::Result;

/// The attention output [B, T, H·D] (see the module docs).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    cached_attention::check(q, k, v, bias)?;
    if flash_attention::serves(q) {
        return flash_attention::flash_attention(q, k, v, bias, scale);
    }
    let tracked = q.track_op() || k.track_op() || v.track_op();
    // The fused softmax runs on the scores (f32, f64 on the CPU): its backward is this node's.
    let softmax_fused = match q.device() {
        Device::Cpu => true,
        Device::Cuda(_) => cuda_kernels() && norm_dtype(q.dtype()) == DType::F32,
        _ => false,
    };
    if !tracked || !softmax_fused {
        return cached_attention::reference(q, k, v, bias, scale);
    }
    let (b, h, t, d) = q.dims4()?;
    let (_, kvh, s, _) = k.dims4()?;
    let rep = h / kvh;
    let dtype = q.dtype();
    let mixed = q.device().is_cuda() && matches!(dtype, DType::BF16 | DType::F16);
    let qg = q.detach().reshape((b, kvh, rep * t, d))?;
    let scores = matmul(&qg, &k.detach().t()?)?.reshape((b, h, t, s))?;
    let (softmax, rounded) = match mixed {
        true => {
            let (rounded, stats) = softmax::masked_softmax_mixed(&scores, bias, scale)?;
            (Softmax::Stats { scores, bias: bias.clone(), stats }, rounded)
        }
        false => {
            let probs = softmax::masked_softmax(&scores.to_dtype(norm_dtype(dtype))?, bias, scale)?;
            let rounded = probs.to_dtype(dtype)?;
            (Softmax::Probs(probs), rounded)
        }
    };
    let folded = rounded.reshape((b, kvh, rep * t, s))?;
    let out = heads_swapped(&matmul(&folded, &v.detach())?.reshape((b, h, t, d))?)?.reshape((b, t, h * d))?;
    let node = AttentionNode { out: NodeOutput::new("attention", out), softmax, folded, scale };
    Ok(q.apply_op3(k, v, node)?)
}

/// The graph node: its output (computed before the node exists) and what the backward reads.
struct AttentionNode {
    out: NodeOutput,
    softmax: Softmax,
    /// P in the inputs' dtype, as [B, KV, REP·T, S]: the weighted sum's operand.
    folded: Tensor,
    scale: f64,
}

/// What the softmax's backward reads.
enum Softmax {
    /// P [B, H, T, S], in the softmax's dtype.
    Probs(Tensor),
    /// bf16/f16 on CUDA (the softmax's mixed kernels): the scores [B, H, T, S], the bias and each
    /// row's max and 1 / sum, from which the backward's kernel computes the f32 P again.
    Stats { scores: Tensor, bias: Tensor, stats: Tensor },
}

impl CustomOp3 for AttentionNode {
    fn name(&self) -> &'static str {
        "attention"
    }

    forward_from_out!(s1 l1, s2 l2, s3 l3);

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let m = |e: crate::Error| candle_core::Error::Msg(e.to_string());
        let (b, h, t, d) = q.dims4()?;
        let (_, kvh, s, _) = k.dims4()?;
        let rep = h / kvh;
        let dtype = q.dtype();
        // The reference's nodes from the last back: reshape, transpose (stored contiguous),
        // reshape; the weighted sum's matmul; reshape and cast; the softmax; cast and reshape;
        // the scores' matmul; k's transpose (stored contiguous) and q's reshape.
        let d_out = heads_swapped(&grad.contiguous()?.reshape((b, t, h, d))?).map_err(m)?;
        let d_out = d_out.reshape((b, kvh, rep * t, d))?;
        let d_folded = matmul(&d_out, &v.t()?).map_err(m)?;
        let dv = matmul(&self.folded.t()?, &d_out).map_err(m)?;
        let d_probs = d_folded.reshape((b, h, t, s))?;
        let d_scores = match &self.softmax {
            Softmax::Stats { scores, bias, stats } => {
                softmax::backward_mixed(scores, bias, stats, &d_probs, self.scale).map_err(m)?
            }
            Softmax::Probs(probs) => {
                let d_probs = d_probs.to_dtype(probs.dtype())?;
                softmax::backward(probs, &d_probs, self.scale).map_err(m)?.to_dtype(dtype)?
            }
        };
        let d_scores = d_scores.reshape((b, kvh, rep * t, s))?;
        let qg = q.reshape((b, kvh, rep * t, d))?;
        let kt = k.t()?;
        let dqg = matmul(&d_scores, &kt.t()?).map_err(m)?;
        let dkt = matmul(&qg.t()?, &d_scores).map_err(m)?;
        let dk = transposed(&dkt).map_err(m)?;
        let dq = dqg.reshape((b, h, t, d))?;
        Ok((Some(dq), Some(dk), Some(dv.contiguous()?)))
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

    /// One node, the reference's values and gradients to the bit: f32 and f64, one kv head per
    /// query head and kv heads shared by three, a masked key (left padding) in one row.
    #[test]
    fn mismatched_shapes_are_errors() {
        let (q, k) = (var(&[1, 2, 3, 4], 1, DType::F32), var(&[1, 0, 3, 4], 2, DType::F32));
        let bias = Tensor::zeros((1, 3, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(attention(q.as_tensor(), k.as_tensor(), k.as_tensor(), &bias, 1.0).is_err());
    }

    #[test]
    fn one_node_gives_the_reference_graphs_bits() {
        for dtype in [DType::F32, DType::F64] {
            for (h, kvh) in [(2, 2), (3, 1)] {
                let (b, t, d) = (2, 5, 4);
                let (q, k, v) =
                    (var(&[b, h, t, d], 1, dtype), var(&[b, kvh, t, d], 2, dtype), var(&[b, kvh, t, d], 3, dtype));
                let mask = vec![vec![1u8; t], [vec![0u8], vec![1u8; t - 1]].concat()];
                let bias = crate::model::transformer::attention_bias(&mask, 0, t, &Device::Cpu).unwrap();
                let w = var(&[b, t, h * d], 4, dtype);
                let run = |f: &dyn Fn() -> Tensor| {
                    let out = f();
                    let grads = (&out * w.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
                    let g = |x: &Var| bits(grads.get(x.as_tensor()).expect("a gradient"));
                    (bits(&out), g(&q), g(&k), g(&v))
                };
                let node = run(&|| attention(&q, &k, &v, &bias, 0.5).unwrap());
                let reference = run(&|| cached_attention::reference(&q, &k, &v, &bias, 0.5).unwrap());
                assert_eq!(node, reference, "{dtype:?}, {h} heads over {kvh}");
            }
        }
    }
}
