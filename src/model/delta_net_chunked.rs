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
/// β \[n\], S [dk, dv] advanced in place (the same arguments as
/// [`super::delta_net::recurrence`]). Runs its products on the calling thread.
pub fn forward<T: Real>(s: &mut [T], q: &[T], k: &[T], v: &[T], g: &[T], beta: &[T], o: &mut [T]) {
    forward_kept(s, q, k, v, g, beta, o, None)
}

/// [`forward`], keeping in `kept` the state before every chunk (what [`backward`] reads).
#[allow(clippy::too_many_arguments)]
pub fn forward_kept<T: Real>(
    s: &mut [T],
    q: &[T],
    k: &[T],
    v: &[T],
    g: &[T],
    beta: &[T],
    o: &mut [T],
    mut kept: Option<&mut Vec<T>>,
) {
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
        if let Some(kept) = kept.as_deref_mut() {
            kept.extend_from_slice(s);
        }
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

/// Gradients of one head's inputs: q, k [n, dk], v [n, dv], g and β \[n\].
pub struct HeadGrads<T> {
    pub q: Vec<T>,
    pub k: Vec<T>,
    pub v: Vec<T>,
    pub g: Vec<T>,
    pub beta: Vec<T>,
}

/// The backward of [`forward_kept`] (its `kept` states) for the outputs' gradient `d_o`
/// [n, dv]; `d_s` holds the gradient of the final state [dk, dv] on entry and that of the
/// starting state on return. Per chunk, last first: the chunk's U, W, Δ recomputed from its
/// kept state, then the products above taken back, (I + A)'s solve by the transposed
/// (backward) substitution, and the cumulative decays' gradients summed back into g.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Real>(
    kept: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    g: &[T],
    beta: &[T],
    d_o: &[T],
    d_s: &mut [T],
) -> HeadGrads<T> {
    let n = g.len();
    let zero = T::of(0.0);
    let (dk, dv) = (q.len().checked_div(n).unwrap_or(0), v.len().checked_div(n).unwrap_or(0));
    let mut out = HeadGrads {
        q: vec![zero; n * dk],
        k: vec![zero; n * dk],
        v: vec![zero; n * dv],
        g: vec![zero; n],
        beta: vec![zero; n],
    };
    if n == 0 {
        return out;
    }
    let cm = CHUNK.min(n);
    let buf = |len: usize| vec![zero; len];
    let (mut gam, mut dgam) = (buf(cm), buf(cm));
    let (mut kk, mut p, mut a, mut dp, mut da) = (buf(cm * cm), buf(cm * cm), buf(cm * cm), buf(cm * cm), buf(cm * cm));
    let (mut u, mut delta, mut ddelta, mut yu) = (buf(cm * dv), buf(cm * dv), buf(cm * dv), buf(cm * dv));
    let (mut w, mut qg, mut kg, mut dkg, mut dqg, mut yw) =
        (buf(cm * dk), buf(cm * dk), buf(cm * dk), buf(cm * dk), buf(cm * dk), buf(cm * dk));
    let ss = dk * dv;
    for ch in (0..n.div_ceil(CHUNK)).rev() {
        let start = ch * CHUNK;
        let c = CHUNK.min(n - start);
        let s = &kept[ch * ss..(ch + 1) * ss];
        let (qc, kc) = (&q[start * dk..(start + c) * dk], &k[start * dk..(start + c) * dk]);
        let (vc, gc, bc) = (&v[start * dv..(start + c) * dv], &g[start..start + c], &beta[start..start + c]);
        let doc = &d_o[start * dv..(start + c) * dv];
        // The forward's chunk again: γ, A, U and −W (solved), Δ, the decayed Q Kᵀ, e^γ q and
        // e^{γ_last−γ} k.
        let mut acc = zero;
        for (x, &gi) in gam.iter_mut().zip(gc) {
            acc += gi;
            *x = acc;
        }
        let last = gam[c - 1];
        matmul(&mut kk, c, Mat::of(kc, c, dk), Mat::of(kc, c, dk).t(), false, false);
        matmul(&mut p, c, Mat::of(qc, c, dk), Mat::of(kc, c, dk).t(), false, false);
        for i in 0..c {
            let (bi, ei) = (bc[i], gam[i].exp());
            for j in 0..c {
                let e = (gam[i] - gam[j]).exp();
                a[i * c + j] = if j < i { bi * e * kk[i * c + j] } else { zero };
                p[i * c + j] = if j <= i { e * p[i * c + j] } else { zero };
            }
            for (x, &y) in u[i * dv..(i + 1) * dv].iter_mut().zip(&vc[i * dv..(i + 1) * dv]) {
                *x = bi * y;
            }
            let (wb, el) = (zero - bi * ei, (last - gam[i]).exp());
            for j in 0..dk {
                let y = kc[i * dk + j];
                w[i * dk + j] = wb * y;
                qg[i * dk + j] = ei * qc[i * dk + j];
                kg[i * dk + j] = el * y;
            }
            for j in 0..i {
                let aij = a[i * c + j];
                let (uj, ui) = u.split_at_mut(i * dv);
                for (x, &y) in ui[..dv].iter_mut().zip(&uj[j * dv..(j + 1) * dv]) {
                    *x -= aij * y;
                }
                let (wj, wi) = w.split_at_mut(i * dk);
                for (x, &y) in wi[..dk].iter_mut().zip(&wj[j * dk..(j + 1) * dk]) {
                    *x -= aij * y;
                }
            }
        }
        delta[..c * dv].copy_from_slice(&u[..c * dv]);
        matmul(&mut delta, dv, Mat::of(&w[..c * dk], c, dk), Mat::of(s, dk, dv), true, false);
        let (wm, um, dm) =
            (Mat::of(&w[..c * dk], c, dk), Mat::of(&u[..c * dv], c, dv), Mat::of(&delta[..c * dv], c, dv));
        let (qgm, kgm, dom) = (Mat::of(&qg[..c * dk], c, dk), Mat::of(&kg[..c * dk], c, dk), Mat::of(doc, c, dv));
        let sm = Mat::of(s, dk, dv);
        dgam[..c].fill(zero);
        // Through S' = e^L S + kgᵀ Δ and O = qg S + P Δ: dΔ, d kg, dP, d qg, and dL.
        matmul(&mut ddelta, dv, Mat::of(&p[..c * c], c, c).t(), dom, false, false);
        matmul(&mut ddelta, dv, kgm, Mat::of(d_s, dk, dv), true, false);
        matmul(&mut dkg, dk, dm, Mat::of(d_s, dk, dv).t(), false, false);
        matmul(&mut dp, c, dom, dm.t(), false, false);
        matmul(&mut dqg, dk, dom, sm.t(), false, false);
        let el = last.exp();
        let mut d_last = zero;
        for (&x, &y) in s.iter().zip(d_s.iter()) {
            d_last += x * y;
        }
        d_last *= el;
        // dS = e^L dS' + qgᵀ dO + (−W)ᵀ dΔ (the state before the chunk).
        for x in d_s.iter_mut() {
            *x *= el;
        }
        matmul(d_s, dv, qgm.t(), dom, true, false);
        matmul(d_s, dv, wm.t(), Mat::of(&ddelta[..c * dv], c, dv), true, false);
        // dq, dk through P (decayed Q Kᵀ) and qg, kg; their decays' share of dγ.
        for i in 0..c {
            for j in 0..=i {
                let t = dp[i * c + j] * p[i * c + j];
                dgam[i] += t;
                dgam[j] -= t;
                dp[i * c + j] *= (gam[i] - gam[j]).exp();
            }
            for j in i + 1..c {
                dp[i * c + j] = zero;
            }
            let (ei, eli) = (gam[i].exp(), (last - gam[i]).exp());
            let (mut tq, mut tk) = (zero, zero);
            for j in 0..dk {
                tq += qg[i * dk + j] * dqg[i * dk + j];
                tk += kg[i * dk + j] * dkg[i * dk + j];
            }
            dgam[i] += tq - tk;
            d_last += tk;
            let dqi = &mut out.q[(start + i) * dk..(start + i + 1) * dk];
            for j in 0..dk {
                dqi[j] += ei * dqg[i * dk + j];
            }
            let dki = &mut out.k[(start + i) * dk..(start + i + 1) * dk];
            for j in 0..dk {
                dki[j] += eli * dkg[i * dk + j];
            }
        }
        let dpm = Mat::of(&dp[..c * c], c, c);
        matmul(&mut out.q[start * dk..(start + c) * dk], dk, dpm, Mat::of(kc, c, dk), true, false);
        matmul(&mut out.k[start * dk..(start + c) * dk], dk, dpm.t(), Mat::of(qc, c, dk), true, false);
        // Through Δ = U + (−W) S: dU = dΔ, d(−W) = dΔ Sᵀ; then (I + A)ᵀ Y = dX, last row first.
        yu[..c * dv].copy_from_slice(&ddelta[..c * dv]);
        matmul(&mut yw, dk, Mat::of(&ddelta[..c * dv], c, dv), sm.t(), false, false);
        for i in (0..c).rev() {
            for j in i + 1..c {
                let aji = a[j * c + i];
                let (yi, yj) = yu.split_at_mut(j * dv);
                for (x, &y) in yi[i * dv..(i + 1) * dv].iter_mut().zip(&yj[..dv]) {
                    *x -= aji * y;
                }
                let (yi, yj) = yw.split_at_mut(j * dk);
                for (x, &y) in yi[i * dk..(i + 1) * dk].iter_mut().zip(&yj[..dk]) {
                    *x -= aji * y;
                }
            }
        }
        // dA = −(Yu Uᵀ + Yw (−W)ᵀ), strictly lower; A_ij = β_i e^{γ_i−γ_j} k_i·k_j.
        matmul(&mut da, c, Mat::of(&yu[..c * dv], c, dv), um.t(), false, false);
        matmul(&mut da, c, Mat::of(&yw[..c * dk], c, dk), wm.t(), true, false);
        for i in 0..c {
            let mut db = zero;
            for j in 0..i {
                let dij = zero - da[i * c + j];
                let e = (gam[i] - gam[j]).exp();
                let t = dij * a[i * c + j];
                dgam[i] += t;
                dgam[j] -= t;
                db += dij * e * kk[i * c + j];
                da[i * c + j] = dij * bc[i] * e;
            }
            for j in i..c {
                da[i * c + j] = zero;
            }
            // U's right side β v, (−W)'s −β e^γ k.
            let (bi, ei) = (bc[i], gam[i].exp());
            let (mut tv, mut tk) = (zero, zero);
            let dvi = &mut out.v[(start + i) * dv..(start + i + 1) * dv];
            for j in 0..dv {
                tv += vc[i * dv + j] * yu[i * dv + j];
                dvi[j] = bi * yu[i * dv + j];
            }
            let dki = &mut out.k[(start + i) * dk..(start + i + 1) * dk];
            for j in 0..dk {
                tk += kc[i * dk + j] * yw[i * dk + j];
                dki[j] -= bi * ei * yw[i * dk + j];
            }
            out.beta[start + i] = db + tv - ei * tk;
            dgam[i] -= bi * ei * tk;
        }
        let dam = Mat::of(&da[..c * c], c, c);
        matmul(&mut out.k[start * dk..(start + c) * dk], dk, dam, Mat::of(kc, c, dk), true, false);
        matmul(&mut out.k[start * dk..(start + c) * dk], dk, dam.t(), Mat::of(kc, c, dk), true, false);
        // γ_i = g_0 + … + g_i and L = γ_last: dg_j = Σ_{i≥j} dγ_i.
        dgam[c - 1] += d_last;
        let mut acc = zero;
        for i in (0..c).rev() {
            acc += dgam[i];
            out.g[start + i] = acc;
        }
    }
    out
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

    /// The chunked backward against central differences of the chunked forward, in f64, for
    /// L = Σ o ⊙ r + Σ S_end ⊙ r' at every input (three chunks, the last partial) and the
    /// starting state.
    #[test]
    fn chunked_backward_matches_finite_differences() {
        let (n, dk, dv) = (150, 6, 4);
        let [q, k, v, g, beta, s0] = inputs::<f64>(n, dk, dv, 21);
        let mut rng = StdRng::seed_from_u64(22);
        let r_o: Vec<f64> = (0..n * dv).map(|_| rng.random_range(-1.0..1.0)).collect();
        let r_s: Vec<f64> = (0..dk * dv).map(|_| rng.random_range(-1.0..1.0)).collect();
        let loss = |x: &[Vec<f64>; 6]| {
            let (mut s, mut o) = (x[5].clone(), vec![0.0; n * dv]);
            forward(&mut s, &x[0], &x[1], &x[2], &x[3], &x[4], &mut o);
            o.iter().zip(&r_o).chain(s.iter().zip(&r_s)).map(|(a, b)| a * b).sum::<f64>()
        };
        let (mut s, mut o, mut kept) = (s0.clone(), vec![0.0; n * dv], vec![]);
        forward_kept(&mut s, &q, &k, &v, &g, &beta, &mut o, Some(&mut kept));
        let mut d_s = r_s.clone();
        let gr = backward(&kept, &q, &k, &v, &g, &beta, &r_o, &mut d_s);
        let x = [q, k, v, g, beta, s0];
        let analytic = [&gr.q, &gr.k, &gr.v, &gr.g, &gr.beta, &d_s];
        let h = 1e-6;
        let mut worst = 0.0f64;
        for (which, grad) in analytic.iter().enumerate() {
            assert_eq!(grad.len(), x[which].len());
            for i in 0..grad.len() {
                let (mut up, mut down) = (x.clone(), x.clone());
                up[which][i] += h;
                down[which][i] -= h;
                let fd = (loss(&up) - loss(&down)) / (2.0 * h);
                let err = (grad[i] - fd).abs() / (1.0 + fd.abs());
                assert!(err < 1e-6, "input {which}, index {i}: analytic {} against {fd}", grad[i]);
                worst = worst.max(err);
            }
        }
        assert!(worst > 0.0);
    }

    /// The two backwards agree from a zero state (the token-by-token one reads its states every
    /// 64 tokens, what `forward_kept` keeps, from the token-by-token forward).
    #[test]
    fn chunked_backward_equals_token_by_token() {
        use crate::model::delta_net::recurrence_backward;
        for (n, seed) in [(1, 30), (64, 31), (100, 32), (200, 33)] {
            let (dk, dv) = (16, 8);
            let [q, k, v, g, beta, _] = inputs::<f64>(n, dk, dv, seed);
            let mut rng = StdRng::seed_from_u64(seed + 100);
            let d_o: Vec<f64> = (0..n * dv).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (mut s, mut o, mut kept) = (vec![0.0; dk * dv], vec![0.0; n * dv], vec![]);
            for st in (0..n).step_by(CHUNK) {
                let e = (st + CHUNK).min(n);
                kept.extend_from_slice(&s);
                let (qs, ks, vs) = (&q[st * dk..e * dk], &k[st * dk..e * dk], &v[st * dv..e * dv]);
                recurrence(&mut s, qs, ks, vs, &g[st..e], &beta[st..e], &mut o[st * dv..e * dv]);
            }
            let want = recurrence_backward(&kept, &q, &k, &v, &g, &beta, &d_o);
            let mut d_s = vec![0.0; dk * dv];
            let got = backward(&kept, &q, &k, &v, &g, &beta, &d_o, &mut d_s);
            for (name, a, b) in
                [("q", &want.0, &got.q), ("k", &want.1, &got.k), ("v", &want.2, &got.v), ("g", &want.3, &got.g)]
                    .into_iter()
                    .chain([("beta", &want.4, &got.beta)])
            {
                let err = a.iter().zip(b.iter()).map(|(x, y)| (x - y).abs() / (1.0 + x.abs())).fold(0.0, f64::max);
                assert!(err < 1e-10, "n = {n}, d{name}: {err:e}");
            }
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
