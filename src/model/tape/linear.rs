//! A projection on slices: y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ, and its backward.
//!
//! Backward, from dy [N, out], with u = x·Aᵀ kept from the forward:
//!   dx = dy·W + s·(dy·B)·A,   dW = dyᵀ·x,   db = Σ_rows dy,   dB = s·dyᵀ·u,   dA = s·(dy·B)ᵀ·x
//! Gradients are computed only for the tensors that are trainable variables (a LoRA run's base
//! weight is frozen and costs no dW product).

use super::matmul::{matmul, product, Mat};
use super::{Grads, Held};
use crate::model::linear::Linear;
use crate::model::ops::{matmul_wt, Real};
use crate::Result;

/// y [n, out] for x [n, in], and u = x·Aᵀ [n, r] when the projection has an adapter.
///
/// In f32 every product is [`xwt`]'s fixed order and the adapter is added as the engine's
/// [`Linear::forward`] adds it, `(x·Wᵀ + b) + (s·u)·Bᵀ`: the trainer's forward is the sampler's,
/// bit for bit.
pub fn forward<T: Real>(lin: &Linear, x: &[T], n: usize) -> Result<(Vec<T>, Option<Vec<T>>)> {
    let (out, inp) = lin.weight.dims2()?;
    let w = Held::<T>::new(&lin.weight)?;
    let mut y = xwt(x, w.slice()?, n, out, inp);
    if let Some(b) = &lin.bias {
        let b = Held::<T>::new(b)?;
        let b = b.slice()?;
        for row in y.chunks_mut(out) {
            for (o, &bi) in row.iter_mut().zip(b) {
                *o += bi;
            }
        }
    }
    let Some(l) = &lin.lora else { return Ok((y, None)) };
    let r = l.a.dim(0)?;
    let (a, bw) = (Held::<T>::new(&l.a)?, Held::<T>::new(&l.b)?);
    let u = xwt(x, a.slice()?, n, r, inp);
    let su: Vec<T> = u.iter().map(|&v| v * T::of(l.scale)).collect();
    for (o, z) in y.iter_mut().zip(xwt(&su, bw.slice()?, n, out, r)) {
        *o += z;
    }
    Ok((y, Some(u)))
}

/// x [n, k] · w [out, k]ᵀ: the fixed-order kernel for f32 ([`matmul_wt::xwt`]), gemm for f64.
pub(super) fn xwt<T: Real>(x: &[T], w: &[T], n: usize, out: usize, k: usize) -> Vec<T> {
    matmul_wt::xwt_real(x, w, n, out, k).unwrap_or_else(|| product(Mat::of(x, n, k), Mat::of(w, out, k).t(), true))
}

/// Adds the projection's input gradient into `dx` [n, in] (a new buffer when it is `None`) and
/// pushes the gradients of its trainable tensors into `grads`.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Real>(
    lin: &Linear,
    x: &[T],
    u: Option<&[T]>,
    dy: &[T],
    n: usize,
    dx: &mut Option<Vec<T>>,
    grads: &mut Grads<T>,
) -> Result<()> {
    let (out, inp) = lin.weight.dims2()?;
    let dy_m = Mat::of(dy, n, out);
    let w = Held::<T>::new(&lin.weight)?;
    let w_m = Mat::of(w.slice()?, out, inp);
    // dx and dW are independent products: run side by side, each over the pool (two products
    // in flight keep more cores busy than one product's own split).
    let (dw, ()) = rayon::join(
        || lin.weight.is_variable().then(|| product(dy_m.t(), Mat::of(x, n, inp), true)),
        || match dx.as_mut() {
            Some(acc) => matmul(acc, inp, dy_m, w_m, true, true),
            None => *dx = Some(product(dy_m, w_m, true)),
        },
    );
    let dx = dx.as_mut().expect("just set");
    if let Some(dw) = dw {
        grads.push(&lin.weight, dw);
    }
    if let Some(b) = lin.bias.as_ref().filter(|b| b.is_variable()) {
        let mut db = vec![T::of(0.0); out];
        for row in dy.chunks(out) {
            for (a, &g) in db.iter_mut().zip(row) {
                *a += g;
            }
        }
        grads.push(b, db);
    }
    let Some(l) = &lin.lora else { return Ok(()) };
    let u = u.expect("the forward kept u for an adapter");
    let r = l.a.dim(0)?;
    let (a, bw) = (Held::<T>::new(&l.a)?, Held::<T>::new(&l.b)?);
    // du = s·dy·B [n, r]
    let mut du = product(dy_m, Mat::of(bw.slice()?, out, r), true);
    du.iter_mut().for_each(|v| *v *= T::of(l.scale));
    matmul(dx, inp, Mat::of(&du, n, r), Mat::of(a.slice()?, r, inp), true, true);
    if l.b.is_variable() {
        let su: Vec<T> = u.iter().map(|&v| v * T::of(l.scale)).collect();
        grads.push(&l.b, product(dy_m.t(), Mat::of(&su, n, r), true));
    }
    if l.a.is_variable() {
        grads.push(&l.a, product(Mat::of(&du, n, r).t(), Mat::of(x, n, inp), true));
    }
    Ok(())
}
