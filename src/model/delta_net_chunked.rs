//! The gated delta rule of one value head in fixed chunks (the WY / UT-transform form of
//! flash-linear-attention's `chunk_gated_delta_rule`): the same recurrence as
//! [`super::delta_net::recurrence`], summed in another order. Not used by training or decoding:
//! both keep the token-by-token order, so that the engine's decode reproduces the trainer's
//! bits; this form exists to measure what that order costs (BENCHMARKS.md, Qwen3.5) and is
//! tested against it.
//!
//! The recurrence, per token i: S_i = e^{g_i}·S_{i−1} + k_i δ_iᵀ, δ_i = β_i(v_i − e^{g_i}·S_{i−1}ᵀk_i),
//! o_i = S_iᵀq_i. Within a chunk of C tokens starting from S (the state before it), with
//! γ_i = g_0 + … + g_i:
//! ```text
//! A_ij = β_i e^{γ_i−γ_j} k_i·k_j  (j < i)          strictly lower triangular, C × C
//! (I + A) U = β ⊙ V,  (I + A) W = β e^γ ⊙ K        one forward substitution for both
//! Δ = U − W S                                        the chunk's δ, [C, dv]
//! O = (e^γ ⊙ Q) S + (e^{γ_i−γ_j} q_i·k_j)_{j≤i} Δ
//! S ← e^{γ_last} S + (e^{γ_last−γ} ⊙ K)ᵀ Δ
//! ```
//! Every product but the substitution is a `gemm` call over the chunk (C = [`CHUNK`], as the
//! reference kernel's), where the token-by-token order reads and writes the whole [dk, dv] state
//! twice per token; the exponents are differences γ_i − γ_j ≤ 0 (g ≤ 0), so nothing overflows.

use crate::model::ops::Real;
use crate::model::tape::matmul::{matmul, Mat};

/// Tokens per chunk.
pub const CHUNK: usize = 64;

/// The chunked recurrence of one value head over n tokens: q, k [n, dk], v and o [n, dv], g and
/// β [n], S [dk, dv] advanced in place (the same arguments as
/// [`super::delta_net::recurrence`]). Runs its products on the calling thread.
pub fn forward<T: Real>(s: &mut [T], q: &[T], k: &[T], v: &[T], g: &[T], beta: &[T], o: &mut [T]) {
    let n = g.len();
    if n == 0 {
        return;
    }
    let (dk, dv) = (q.len() / n, v.len() / n);
    let zero = T::of(0.0);
    let c_max = CHUNK.min(n);
    let (mut gam, mut kk, mut qk) = (vec![zero; c_max], vec![zero; c_max * c_max], vec![zero; c_max * c_max]);
    let (mut u, mut w) = (vec![zero; c_max * dv], vec![zero; c_max * dk]);
    let (mut qg, mut kg) = (vec![zero; c_max * dk], vec![zero; c_max * dk]);
    for start in (0..n).step_by(CHUNK) {
        let c = CHUNK.min(n - start);
        let (qc, kc) = (&q[start * dk..(start + c) * dk], &k[start * dk..(start + c) * dk]);
        let (vc, gc, bc) = (&v[start * dv..(start + c) * dv], &g[start..start + c], &beta[start..start + c]);
        let oc = &mut o[start * dv..(start + c) * dv];
        let mut acc = zero;
        for (x, &gi) in gam.iter_mut().zip(gc) {
            acc += gi;
            *x = acc;
        }
        let last = gam[c - 1];
        // K Kᵀ and Q Kᵀ, [c, c].
        matmul(&mut kk, c, Mat::of(kc, c, dk), Mat::of(kc, c, dk).t(), false, false);
        matmul(&mut qk, c, Mat::of(qc, c, dk), Mat::of(kc, c, dk).t(), false, false);
        // Right-hand sides: U ← β v, W ← −β e^γ k (negated, so that Δ = U + W S is one
        // accumulating product), then the forward substitution X_i −= A_ij X_j, j < i.
        for i in 0..c {
            let (bi, ei) = (bc[i], gam[i].exp());
            for (x, &y) in u[i * dv..(i + 1) * dv].iter_mut().zip(&vc[i * dv..(i + 1) * dv]) {
                *x = bi * y;
            }
            let wb = zero - bi * ei;
            for (x, &y) in w[i * dk..(i + 1) * dk].iter_mut().zip(&kc[i * dk..(i + 1) * dk]) {
                *x = wb * y;
            }
            for j in 0..i {
                let a = bi * (gam[i] - gam[j]).exp() * kk[i * c + j];
                let (uj, ui) = u.split_at_mut(i * dv);
                for (x, &y) in ui[..dv].iter_mut().zip(&uj[j * dv..(j + 1) * dv]) {
                    *x -= a * y;
                }
                let (wj, wi) = w.split_at_mut(i * dk);
                for (x, &y) in wi[..dk].iter_mut().zip(&wj[j * dk..(j + 1) * dk]) {
                    *x -= a * y;
                }
            }
        }
        // Δ = U − W S, in u.
        matmul(&mut u, dv, Mat::of(&w[..c * dk], c, dk), Mat::of(s, dk, dv), true, false);
        // O = (e^γ ⊙ Q) S + (decay-masked Q Kᵀ) Δ.
        for i in 0..c {
            let ei = gam[i].exp();
            for (x, &y) in qg[i * dk..(i + 1) * dk].iter_mut().zip(&qc[i * dk..(i + 1) * dk]) {
                *x = ei * y;
            }
            for j in 0..c {
                qk[i * c + j] = if j <= i { (gam[i] - gam[j]).exp() * qk[i * c + j] } else { zero };
            }
            let ej = (last - gam[i]).exp();
            for (x, &y) in kg[i * dk..(i + 1) * dk].iter_mut().zip(&kc[i * dk..(i + 1) * dk]) {
                *x = ej * y;
            }
        }
        matmul(oc, dv, Mat::of(&qg[..c * dk], c, dk), Mat::of(s, dk, dv), false, false);
        matmul(oc, dv, Mat::of(&qk[..c * c], c, c), Mat::of(&u[..c * dv], c, dv), true, false);
        // S ← e^{γ_last} S + (e^{γ_last−γ} ⊙ K)ᵀ Δ.
        let el = last.exp();
        for x in s.iter_mut() {
            *x *= el;
        }
        matmul(s, dv, Mat::of(&kg[..c * dk], c, dk).t(), Mat::of(&u[..c * dv], c, dv), true, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::delta_net::recurrence;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// One head's random inputs as the layer makes them: q and k of unit norm (q scaled by
    /// 1/√dk), g = −e^A·softplus(·) ≤ 0, β in (0, 1), and a nonzero starting state.
    #[allow(clippy::type_complexity)]
    fn inputs<T: Real>(n: usize, dk: usize, dv: usize, seed: u64) -> [Vec<T>; 6] {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut unit = |scale: f64| {
            let x: Vec<f64> = (0..dk).map(|_| rng.random_range(-1.0..1.0)).collect();
            let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
            x.into_iter().map(move |v| T::of(v / norm * scale)).collect::<Vec<T>>()
        };
        let q: Vec<T> = (0..n).flat_map(|_| unit(1.0 / (dk as f64).sqrt())).collect();
        let k: Vec<T> = (0..n).flat_map(|_| unit(1.0)).collect();
        let mut rng = StdRng::seed_from_u64(seed + 1);
        let v = (0..n * dv).map(|_| T::of(rng.random_range(-2.0..2.0))).collect();
        let g = (0..n).map(|_| T::of(-rng.random_range(0.0..0.5))).collect();
        let beta = (0..n).map(|_| T::of(rng.random_range(0.05..0.95))).collect();
        let s = (0..dk * dv).map(|_| T::of(rng.random_range(-0.5..0.5))).collect();
        [q, k, v, g, beta, s]
    }

    /// Largest |a − b| / (1 + |b|) over outputs and final states.
    fn compare<T: Real + Into<f64>>(n: usize, dk: usize, dv: usize, seed: u64) -> f64 {
        let [q, k, v, g, beta, s0] = inputs::<T>(n, dk, dv, seed);
        let (mut s_ref, mut s_ch) = (s0.clone(), s0);
        let (mut o_ref, mut o_ch) = (vec![T::of(0.0); n * dv], vec![T::of(9.0); n * dv]);
        recurrence(&mut s_ref, &q, &k, &v, &g, &beta, &mut o_ref);
        forward(&mut s_ch, &q, &k, &v, &g, &beta, &mut o_ch);
        o_ref
            .iter()
            .zip(&o_ch)
            .chain(s_ref.iter().zip(&s_ch))
            .map(|(&a, &b)| {
                let (a, b): (f64, f64) = (a.into(), b.into());
                (a - b).abs() / (1.0 + a.abs())
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn chunked_equals_token_by_token_in_f64() {
        for (i, n) in [1, 5, 63, 64, 65, 130, 200].into_iter().enumerate() {
            let err = compare::<f64>(n, 16, 8, i as u64);
            assert!(err < 1e-10, "n = {n}: {err:e}");
        }
    }

    #[test]
    fn chunked_equals_token_by_token_in_f32() {
        for (i, n) in [7, 64, 129, 300].into_iter().enumerate() {
            let err = compare::<f32>(n, 128, 128, 10 + i as u64);
            assert!(err < 1e-5, "n = {n}: {err:e}");
        }
    }

    /// The comparison can fail: a chunked sum whose decay is off by one token is caught.
    #[test]
    fn a_wrong_decay_is_caught() {
        let (n, dk, dv) = (70, 16, 8);
        let [q, k, v, mut g, beta, s0] = inputs::<f64>(n, dk, dv, 3);
        let (mut s_ref, mut s_ch) = (s0.clone(), s0);
        let (mut o_ref, mut o_ch) = (vec![0.0; n * dv], vec![0.0; n * dv]);
        recurrence(&mut s_ref, &q, &k, &v, &g, &beta, &mut o_ref);
        g[40] += 1e-6;
        forward(&mut s_ch, &q, &k, &v, &g, &beta, &mut o_ch);
        let err = o_ref.iter().zip(&o_ch).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err > 1e-10, "{err:e}");
    }
}
