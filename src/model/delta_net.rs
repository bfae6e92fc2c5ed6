//! Qwen3.5's Gated DeltaNet layer (linear attention): forward and backward on slices, one
//! summation order for training and decoding.
//!
//! ```text
//! qkv = in_proj_qkv(x), z = in_proj_z(x), a = in_proj_a(x), b = in_proj_b(x)
//! u   = silu(causal depthwise conv1d(qkv))          kernel K over each channel's last K inputs
//! q, k, v = split(u);  q ← l2norm(q)/√dk, k ← l2norm(k)   (per key head; value head h reads key
//!                                                          head h / (nv/nk))
//! g = −exp(A_log)·softplus(a + dt_bias),  β = σ(b)        (per value head)
//! per value head, S [dk, dv] from 0, token by token:
//!     S ← e^g·S;  δ = β·(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq
//! y = out_proj(rms_norm(o)·w ⊙ silu(z))                   (RMSNorm per head over dv)
//! ```
//! The recurrence runs token by token, in the one order of `step`, in the trainer's forward
//! and in the engine's prefill and decode (where S and the last K−1 conv inputs are the state a
//! row carries instead of a KV cache), so a sampled token's log-prob is the trainer's bits. It
//! is what transformers' recurrent kernel computes; its chunked training kernel sums in another
//! order (float-close, not equal). That chunked (WY) order, [`super::delta_net_chunked`], is much
//! faster on the CPU, the backward above all (gemms over 64-token chunks, where this order reads
//! and writes the whole state several times per token); it is kept beside this one for tests and
//! measurement only, since a decode would have to reproduce its chunks to keep the trainer's bits
//! (BENCHMARKS.md, Qwen3.5, has what this order costs the training step). A masked (padding) token is skipped: it leaves the state and
//! the conv history as they were and outputs zeros (for left padding, what transformers' zeroed
//! inputs give).
//!
//! The backward keeps the state every `CHECKPOINT` tokens; per value head it recomputes a
//! chunk's states from its checkpoint (the forward's bits) and walks the chunk back:
//! ```text
//! dS += q doᵀ;  dq = S do;  dk = dS δ;  dδ = dSᵀk;  dv = β dδ;  dβ = dδ·(v − m)
//! dm = −β dδ (m = Sdᵀk, Sd = e^g S₋);  dSd = dS + k dmᵀ;  dk += Sd dm;  dg = Σ dSd ⊙ Sd
//! dS₋ = e^g dSd
//! ```
//! then through the l2 norms, the gates (dA_log = dg·g, d(a + dt_bias) = −dg·e^A_log·σ(a + dt_bias)),
//! the SiLU and the convolution. Rows and value heads run side by side on the rayon pool; every
//! sum over rows or heads is taken in a fixed order (the thread count changes no bit).

use candle_core::{DType, Tensor, WithDType};
use rayon::prelude::*;

use super::linear::Linear;
use super::model_config::DeltaNetConfig;
use super::ops::{rms_norm, Real};
use super::row_adapters::RowAdapters;
use crate::{Error, Result};

/// Tokens between two kept states in a recorded forward.
const CHECKPOINT: usize = 64;
/// The l2 norm's epsilon (transformers' `l2norm`).
const L2_EPS: f64 = 1e-6;
/// softplus(x) = x above this, as torch's default threshold.
const SOFTPLUS_THRESHOLD: f64 = 20.0;

/// One Gated DeltaNet layer's parameters.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    pub in_proj_qkv: Linear,
    pub in_proj_z: Linear,
    pub in_proj_b: Linear,
    pub in_proj_a: Linear,
    pub out_proj: Linear,
    /// [conv_dim, 1, kernel]
    pub conv1d: Tensor,
    /// [value heads]
    pub a_log: Tensor,
    /// [value heads]
    pub dt_bias: Tensor,
    /// The gated RMSNorm's weight \[value_head_dim\] (plain scale, no `1 +`).
    pub norm: Tensor,
}

/// A batch's sizes.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub cfg: DeltaNetConfig,
}

/// Floats of one row's state: the last K−1 conv inputs [K−1, conv_dim], then S per value head
/// [nv, dk, dv].
pub fn state_len(c: &DeltaNetConfig) -> usize {
    conv_state_len(c) + c.num_value_heads * c.key_head_dim * c.value_head_dim
}

fn conv_state_len(c: &DeltaNetConfig) -> usize {
    (c.conv_kernel - 1) * c.conv_dim()
}

/// Rows of DeltaNet state ([`state_len`] floats each) on the host, in the compute dtype: a
/// decode step advances them in place (no copy in or out per step); row surgery copies rows.
#[derive(Debug, Clone, PartialEq)]
pub enum StateRows {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// The floats a [`StateRows`] holds.
pub trait StateFloat: Real {
    fn rows_mut(s: &mut StateRows) -> Option<&mut Vec<Self>>;
    fn wrap(v: Vec<Self>) -> StateRows;
}

impl StateFloat for f32 {
    fn rows_mut(s: &mut StateRows) -> Option<&mut Vec<f32>> {
        match s {
            StateRows::F32(v) => Some(v),
            StateRows::F64(_) => None,
        }
    }
    fn wrap(v: Vec<f32>) -> StateRows {
        StateRows::F32(v)
    }
}

impl StateFloat for f64 {
    fn rows_mut(s: &mut StateRows) -> Option<&mut Vec<f64>> {
        match s {
            StateRows::F64(v) => Some(v),
            StateRows::F32(_) => None,
        }
    }
    fn wrap(v: Vec<f64>) -> StateRows {
        StateRows::F64(v)
    }
}

impl StateRows {
    fn len(&self) -> usize {
        match self {
            StateRows::F32(v) => v.len(),
            StateRows::F64(v) => v.len(),
        }
    }

    /// Rows of `width` floats.
    pub fn num_rows(&self, width: usize) -> usize {
        self.len() / width.max(1)
    }

    /// The given rows (a row may repeat), in that order.
    pub fn select(&self, rows: &[usize], width: usize) -> StateRows {
        fn pick<T: Copy>(v: &[T], rows: &[usize], w: usize) -> Vec<T> {
            rows.iter().flat_map(|&r| v[r * w..(r + 1) * w].iter().copied()).collect()
        }
        match self {
            StateRows::F32(v) => StateRows::F32(pick(v, rows, width)),
            StateRows::F64(v) => StateRows::F64(pick(v, rows, width)),
        }
    }

    /// `rows` zero rows of `like`'s dtype (a row that has seen nothing yet).
    pub fn zeros_like(like: &StateRows, rows: usize, width: usize) -> StateRows {
        match like {
            StateRows::F32(_) => StateRows::F32(vec![0.0; rows * width]),
            StateRows::F64(_) => StateRows::F64(vec![0.0; rows * width]),
        }
    }

    /// The parts' rows one after another (all of one dtype).
    pub fn concat(parts: &[StateRows]) -> Result<StateRows> {
        let mut out = match parts.first() {
            Some(p) => StateRows::zeros_like(p, 0, 1),
            None => return Err(Error::Other("DeltaNet states: nothing to concatenate".into())),
        };
        for p in parts {
            match (&mut out, p) {
                (StateRows::F32(a), StateRows::F32(b)) => a.extend_from_slice(b),
                (StateRows::F64(a), StateRows::F64(b)) => a.extend_from_slice(b),
                _ => return Err(Error::Other("DeltaNet states of two dtypes in one batch".into())),
            }
        }
        Ok(out)
    }
}

/// The layer's non-projection parameters as slices.
pub struct Params<'a, T> {
    /// [conv_dim, kernel]
    pub conv: &'a [T],
    pub a_log: &'a [T],
    pub dt_bias: &'a [T],
    pub norm: &'a [T],
    pub eps: f64,
}

/// What the backward reads besides the projections' outputs.
pub struct Record<T> {
    /// Conv outputs before the SiLU [B·T, conv_dim] (zeros at masked tokens).
    y_pre: Vec<T>,
    /// The recurrence's output before the gated norm [B·T, value_dim].
    o: Vec<T>,
    /// Per (row, value head): S before every CHECKPOINT-th real token.
    checkpoints: Vec<Vec<T>>,
    /// Per row: its real tokens' positions.
    real: Vec<Vec<usize>>,
}

fn sigmoid<T: Real>(x: T) -> T {
    T::of(1.0) / (T::of(1.0) + (T::of(0.0) - x).exp())
}

fn silu<T: Real>(x: T) -> T {
    x * sigmoid(x)
}

fn silu_grad<T: Real>(x: T) -> T {
    let s = sigmoid(x);
    s * (T::of(1.0) + x * (T::of(1.0) - s))
}

fn softplus<T: Real>(x: T) -> T {
    if x > T::of(SOFTPLUS_THRESHOLD) {
        x
    } else {
        (T::of(1.0) + x.exp()).ln()
    }
}

fn softplus_grad<T: Real>(x: T) -> T {
    if x > T::of(SOFTPLUS_THRESHOLD) {
        T::of(1.0)
    } else {
        sigmoid(x)
    }
}

/// 1/√(Σx² + eps), summed left to right.
fn inv_l2<T: Real>(x: &[T]) -> T {
    let mut s = T::of(0.0);
    for &v in x {
        s += v * v;
    }
    T::of(1.0) / (s + T::of(L2_EPS)).sqrt()
}

/// One token of the recurrence for one value head: S [dk, dv] ← e^g·S, δ = β(v − Sᵀk),
/// S ← S + kδᵀ, o = Sᵀq. `kv` is scratch of dv. The one summation order of training and
/// decoding.
#[inline]
#[allow(clippy::too_many_arguments)] // the recurrence's state, inputs and outputs, one slice each
fn step<T: Real>(s: &mut [T], q: &[T], k: &[T], v: &[T], g: T, beta: T, o: &mut [T], kv: &mut [T]) {
    let dv = v.len();
    let decay = g.exp();
    kv.fill(T::of(0.0));
    for (row, &ki) in s.chunks_mut(dv).zip(k) {
        for (x, m) in row.iter_mut().zip(kv.iter_mut()) {
            *x *= decay;
            *m += *x * ki;
        }
    }
    for (m, &vj) in kv.iter_mut().zip(v) {
        *m = (vj - *m) * beta;
    }
    o.fill(T::of(0.0));
    for ((row, &ki), &qi) in s.chunks_mut(dv).zip(k).zip(q) {
        for ((x, &d), oj) in row.iter_mut().zip(kv.iter()).zip(o.iter_mut()) {
            *x += ki * d;
            *oj += *x * qi;
        }
    }
}

/// The recurrence of one value head over n tokens, token by token in `step`'s order (the
/// forward's inner loop, without its checkpoints): q, k [n, dk], v and o [n, dv], g and β \[n\],
/// S [dk, dv] advanced in place. The reference [`super::delta_net_chunked`] is tested and
/// measured against.
pub fn recurrence<T: Real>(s: &mut [T], q: &[T], k: &[T], v: &[T], g: &[T], beta: &[T], o: &mut [T]) {
    let n = g.len();
    let (dk, dv) = (q.len() / n.max(1), v.len() / n.max(1));
    let mut kv = vec![T::of(0.0); dv];
    for i in 0..n {
        let (qi, ki, vi) = (&q[i * dk..(i + 1) * dk], &k[i * dk..(i + 1) * dk], &v[i * dv..(i + 1) * dv]);
        step(s, qi, ki, vi, g[i], beta[i], &mut o[i * dv..(i + 1) * dv], &mut kv);
    }
}

/// The backward of [`recurrence`] from a zero state, as training runs it: `kept` holds S before
/// every `CHECKPOINT`-th token (the recorded forward's); per chunk, last first, the chunk's
/// states are recomputed from its checkpoint (the forward's bits) and walked back. Returns dq,
/// dk [n, dk], dv [n, dv], dg and dβ \[n\] for the outputs' gradient `d_o` [n, dv].
#[allow(clippy::type_complexity)]
pub fn recurrence_backward<T: Real>(
    kept: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    g: &[T],
    beta: &[T],
    d_o: &[T],
) -> (Vec<T>, Vec<T>, Vec<T>, Vec<T>, Vec<T>) {
    let n = g.len();
    let (dk, dv) = (q.len() / n.max(1), v.len() / n.max(1));
    let (mut dq, mut dk_, mut dvv) = (vec![T::of(0.0); n * dk], vec![T::of(0.0); n * dk], vec![T::of(0.0); n * dv]);
    let (mut dg, mut dbeta) = (vec![T::of(0.0); n], vec![T::of(0.0); n]);
    let ss = dk * dv;
    let mut ds = vec![T::of(0.0); ss];
    let (mut kv, mut scratch) = (vec![T::of(0.0); dv], vec![T::of(0.0); dv]);
    let (mut m, mut ddelta, mut dm) = (vec![T::of(0.0); dv], vec![T::of(0.0); dv], vec![T::of(0.0); dv]);
    let mut sd = vec![T::of(0.0); ss];
    let chunks = n.div_ceil(CHECKPOINT);
    for ch in (0..chunks).rev() {
        let start = ch * CHECKPOINT;
        let len = CHECKPOINT.min(n - start);
        // states[i] = S before token start + i; states[len] = after the last.
        let mut states = Vec::with_capacity((len + 1) * ss);
        states.extend_from_slice(&kept[ch * ss..(ch + 1) * ss]);
        let mut s = states.clone();
        for i in 0..len {
            let ti = start + i;
            let q = &q[ti * dk..][..dk];
            let k = &k[ti * dk..][..dk];
            let v = &v[ti * dv..][..dv];
            step(&mut s, q, k, v, g[ti], beta[ti], &mut scratch, &mut kv);
            states.extend_from_slice(&s);
        }
        for i in (0..len).rev() {
            let ti = start + i;
            let q = &q[ti * dk..][..dk];
            let k = &k[ti * dk..][..dk];
            let v = &v[ti * dv..][..dv];
            let (g, beta) = (g[ti], beta[ti]);
            let s_prev = &states[i * ss..(i + 1) * ss];
            let s_t = &states[(i + 1) * ss..(i + 2) * ss];
            let dout = &d_o[ti * dv..][..dv];
            let decay = g.exp();
            // Recomputed as the forward did: Sd = e^g S₋, m = Sdᵀk, δ = β(v − m).
            m.fill(T::of(0.0));
            for ((sdr, spr), &ki) in sd.chunks_mut(dv).zip(s_prev.chunks(dv)).zip(k) {
                for ((x, &y), mj) in sdr.iter_mut().zip(spr).zip(m.iter_mut()) {
                    *x = y * decay;
                    *mj += *x * ki;
                }
            }
            // dS += q doᵀ; dq = S_t do.
            let dqi = &mut dq[ti * dk..(ti + 1) * dk];
            for (i2, (dsr, str_)) in ds.chunks_mut(dv).zip(s_t.chunks(dv)).enumerate() {
                let qi = q[i2];
                let mut acc = T::of(0.0);
                for ((x, &sv), &dj) in dsr.iter_mut().zip(str_).zip(dout) {
                    *x += qi * dj;
                    acc += sv * dj;
                }
                dqi[i2] = acc;
            }
            // dk = dS δ; dδ = dSᵀk.
            ddelta.fill(T::of(0.0));
            let dki = &mut dk_[ti * dk..(ti + 1) * dk];
            for (i2, dsr) in ds.chunks(dv).enumerate() {
                let ki = k[i2];
                let mut acc = T::of(0.0);
                for (j, &x) in dsr.iter().enumerate() {
                    acc += x * (beta * (v[j] - m[j]));
                    ddelta[j] += x * ki;
                }
                dki[i2] = acc;
            }
            let mut db = T::of(0.0);
            let dvi = &mut dvv[ti * dv..(ti + 1) * dv];
            for j in 0..dv {
                dvi[j] = beta * ddelta[j];
                db += ddelta[j] * (v[j] - m[j]);
                dm[j] = T::of(0.0) - beta * ddelta[j];
            }
            dbeta[ti] = db;
            // dSd = dS + k dmᵀ; dk += Sd dm; dg = Σ dSd ⊙ Sd; dS₋ = e^g dSd.
            let mut dgi = T::of(0.0);
            for (i2, (dsr, sdr)) in ds.chunks_mut(dv).zip(sd.chunks(dv)).enumerate() {
                let ki = k[i2];
                let mut acc = T::of(0.0);
                for ((x, &y), &dmj) in dsr.iter_mut().zip(sdr).zip(dm.iter()) {
                    *x += ki * dmj;
                    acc += y * dmj;
                    dgi += *x * y;
                    *x *= decay;
                }
                dki[i2] += acc;
            }
            dg[ti] = dgi;
        }
    }
    (dq, dk_, dvv, dg, dbeta)
}

/// Per real token of one row: the normalised, scaled q [nk·dk], normalised k [nk·dk], v (a view
/// of the activations), g [nv] and β [nv], from the conv outputs before the SiLU.
struct Gates<T> {
    act: Vec<T>,
    q: Vec<T>,
    k: Vec<T>,
    g: Vec<T>,
    beta: Vec<T>,
}

fn gates<T: Real>(y_pre: &[T], a: &[T], b: &[T], p: &Params<T>, c: &DeltaNetConfig, real: &[usize]) -> Gates<T> {
    let (cd, kd, nv, dk) = (c.conv_dim(), c.key_dim(), c.num_value_heads, c.key_head_dim);
    let n = real.len();
    let scale = T::of(1.0 / (dk as f64).sqrt());
    let mut out = Gates {
        act: Vec::with_capacity(n * cd),
        q: vec![T::of(0.0); n * kd],
        k: vec![T::of(0.0); n * kd],
        g: vec![T::of(0.0); n * nv],
        beta: vec![T::of(0.0); n * nv],
    };
    let neg_a: Vec<T> = p.a_log.iter().map(|&x| T::of(0.0) - x.exp()).collect();
    for (i, &t) in real.iter().enumerate() {
        out.act.extend(y_pre[t * cd..(t + 1) * cd].iter().map(|&x| silu(x)));
        let act = &out.act[i * cd..(i + 1) * cd];
        for (h, (qo, ko)) in
            out.q[i * kd..(i + 1) * kd].chunks_mut(dk).zip(out.k[i * kd..(i + 1) * kd].chunks_mut(dk)).enumerate()
        {
            let (qx, kx) = (&act[h * dk..(h + 1) * dk], &act[kd + h * dk..kd + (h + 1) * dk]);
            let (rq, rk) = (inv_l2(qx), inv_l2(kx));
            for j in 0..dk {
                qo[j] = qx[j] * rq * scale;
                ko[j] = kx[j] * rk;
            }
        }
        for h in 0..nv {
            out.g[i * nv + h] = neg_a[h] * softplus(a[t * nv + h] + p.dt_bias[h]);
            out.beta[i * nv + h] = sigmoid(b[t * nv + h]);
        }
    }
    out
}

/// The causal conv of one row over its real tokens, continuing from `hist` (the last K−1 inputs
/// [K−1, conv_dim]), which it advances: writes y_pre [T, conv_dim] at the real tokens.
fn conv_row<T: Real>(u: &[T], real: &[usize], hist: &mut [T], w: &[T], c: &DeltaNetConfig, y_pre: &mut [T]) {
    let (cd, kk) = (c.conv_dim(), c.conv_kernel);
    let mut ext = Vec::with_capacity((kk - 1 + real.len()) * cd);
    ext.extend_from_slice(hist);
    for &t in real {
        ext.extend_from_slice(&u[t * cd..(t + 1) * cd]);
    }
    for (i, &t) in real.iter().enumerate() {
        let out = &mut y_pre[t * cd..(t + 1) * cd];
        for (ch, o) in out.iter_mut().enumerate() {
            let mut s = T::of(0.0);
            for j in 0..kk {
                s += w[ch * kk + j] * ext[(i + j) * cd + ch];
            }
            *o = s;
        }
    }
    hist.copy_from_slice(&ext[ext.len() - (kk - 1) * cd..]);
}

fn real_tokens(mask: &[u8]) -> Vec<usize> {
    mask.iter().enumerate().filter(|(_, &m)| m != 0).map(|(t, _)| t).collect()
}

/// The layer between its projections: from qkv [B·T, conv_dim], z [B·T, value_dim], a and b
/// [B·T, nv] to the out_proj input [B·T, value_dim], advancing each row's `state` (B rows of
/// [`state_len`]). With `record`, what [`backward`] needs (the state must then start at zero).
#[allow(clippy::too_many_arguments)]
pub fn forward<T: Real>(
    qkv: &[T],
    z: &[T],
    a: &[T],
    b: &[T],
    p: &Params<T>,
    mask: &[Vec<u8>],
    state: &mut [T],
    dims: Dims,
    record: bool,
) -> (Vec<T>, Option<Record<T>>) {
    let Dims { b: rows, t, cfg: c } = dims;
    let (cd, vd, nv, nk, dk, dv) =
        (c.conv_dim(), c.value_dim(), c.num_value_heads, c.num_key_heads, c.key_head_dim, c.value_head_dim);
    let (csl, sl) = (conv_state_len(&c), state_len(&c));
    let kd = c.key_dim();
    let group = nv / nk;
    let real: Vec<Vec<usize>> = mask.iter().map(|m| real_tokens(m)).collect();
    // Convolution and gates, a task per row.
    let mut y_pre = vec![T::of(0.0); rows * t * cd];
    let row_gates: Vec<Gates<T>> = y_pre
        .par_chunks_mut(t * cd)
        .zip(state.par_chunks_mut(sl))
        .enumerate()
        .map(|(r, (y, st))| {
            let u = &qkv[r * t * cd..(r + 1) * t * cd];
            conv_row(u, &real[r], &mut st[..csl], p.conv, &c, y);
            let (ar, br) = (&a[r * t * nv..(r + 1) * t * nv], &b[r * t * nv..(r + 1) * t * nv]);
            gates(y, ar, br, p, &c, &real[r])
        })
        .collect();
    // The recurrence, a task per (row, value head).
    let mut heads: Vec<(usize, usize, &mut [T])> = vec![];
    for (r, st) in state.chunks_mut(sl).enumerate() {
        for (h, s) in st[csl..].chunks_mut(dk * dv).enumerate() {
            heads.push((r, h, s));
        }
    }
    let outs: Vec<(Vec<T>, Vec<T>)> = heads
        .into_par_iter()
        .map(|(r, h, s)| {
            let gt = &row_gates[r];
            let n = real[r].len();
            let kh = h / group;
            let mut o = vec![T::of(0.0); n * dv];
            let mut kept = vec![];
            let mut kv = vec![T::of(0.0); dv];
            for i in 0..n {
                if record && i % CHECKPOINT == 0 {
                    kept.extend_from_slice(s);
                }
                let q = &gt.q[i * kd + kh * dk..][..dk];
                let k = &gt.k[i * kd + kh * dk..][..dk];
                let v = &gt.act[i * cd + 2 * kd + h * dv..][..dv];
                step(s, q, k, v, gt.g[i * nv + h], gt.beta[i * nv + h], &mut o[i * dv..(i + 1) * dv], &mut kv);
            }
            (o, kept)
        })
        .collect();
    let mut o = vec![T::of(0.0); rows * t * vd];
    let mut checkpoints = Vec::with_capacity(outs.len());
    for (idx, (oh, kept)) in outs.into_iter().enumerate() {
        let (r, h) = (idx / nv, idx % nv);
        for (i, &tk) in real[r].iter().enumerate() {
            o[(r * t + tk) * vd + h * dv..][..dv].copy_from_slice(&oh[i * dv..(i + 1) * dv]);
        }
        checkpoints.push(kept);
    }
    let out = gated_norm(&o, z, p);
    let rec = record.then_some(Record { y_pre, o, checkpoints, real });
    (out, rec)
}

/// rms_norm(o)·w ⊙ silu(z), per head (rows of dv).
fn gated_norm<T: Real>(o: &[T], z: &[T], p: &Params<T>) -> Vec<T> {
    let mut n = rms_norm::forward(o, p.norm, p.eps);
    n.par_chunks_mut(16_384).zip(z.par_chunks(16_384)).for_each(|(n, z)| {
        for (x, &zz) in n.iter_mut().zip(z) {
            *x *= silu(zz);
        }
    });
    n
}

/// Gradients of the layer's inputs and parameters.
pub struct Grads<T> {
    pub qkv: Vec<T>,
    pub z: Vec<T>,
    pub a: Vec<T>,
    pub b: Vec<T>,
    pub conv: Vec<T>,
    pub a_log: Vec<T>,
    pub dt_bias: Vec<T>,
    pub norm: Vec<T>,
}

/// The backward of [`forward`] (recorded from a zero state) for the output gradient `d_out`
/// [B·T, value_dim].
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Real>(
    qkv: &[T],
    z: &[T],
    a: &[T],
    b: &[T],
    p: &Params<T>,
    rec: &Record<T>,
    d_out: &[T],
    dims: Dims,
) -> Grads<T> {
    let Dims { b: rows, t, cfg: c } = dims;
    let (cd, vd, nv, nk, dk, dv, kk) = (
        c.conv_dim(),
        c.value_dim(),
        c.num_value_heads,
        c.num_key_heads,
        c.key_head_dim,
        c.value_head_dim,
        c.conv_kernel,
    );
    let kd = c.key_dim();
    let group = nv / nk;
    // Gated norm: out = n ⊙ silu(z), n = rms_norm(o)·w.
    let n = rms_norm::forward(&rec.o, p.norm, p.eps);
    let mut dn = vec![T::of(0.0); n.len()];
    let mut dz = vec![T::of(0.0); n.len()];
    dn.par_chunks_mut(16_384).zip(dz.par_chunks_mut(16_384)).enumerate().for_each(|(ci, (dn, dz))| {
        let base = ci * 16_384;
        for (j, (dnj, dzj)) in dn.iter_mut().zip(dz.iter_mut()).enumerate() {
            let (g, zz) = (d_out[base + j], z[base + j]);
            *dnj = g * silu(zz);
            *dzj = g * n[base + j] * silu_grad(zz);
        }
    });
    let mut d_o = vec![T::of(0.0); rec.o.len()];
    let mut d_norm = vec![T::of(0.0); dv];
    rms_norm::backward(&rec.o, &dn, p.norm, p.eps, &mut d_o, &mut d_norm);
    drop(dn);

    let row_gates: Vec<Gates<T>> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let y = &rec.y_pre[r * t * cd..(r + 1) * t * cd];
            gates(y, &a[r * t * nv..(r + 1) * t * nv], &b[r * t * nv..(r + 1) * t * nv], p, &c, &rec.real[r])
        })
        .collect();
    // The recurrence backward, a task per (row, value head): dq, dk [n, dk], dv [n, dv],
    // dg, dβ [n].
    type HeadGrads<T> = (Vec<T>, Vec<T>, Vec<T>, Vec<T>, Vec<T>);
    let head_grads: Vec<HeadGrads<T>> = (0..rows * nv)
        .into_par_iter()
        .map(|idx| {
            let (r, h) = (idx / nv, idx % nv);
            let gt = &row_gates[r];
            let real = &rec.real[r];
            let kh = h / group;
            // The head's inputs gathered contiguous (a copy the size of the activations, small
            // beside the recurrence's dk·dv per token).
            let gather = |src: &[T], stride: usize, off: usize, len: usize| -> Vec<T> {
                (0..real.len()).flat_map(|i| src[i * stride + off..][..len].iter().copied()).collect()
            };
            let (q, k) = (gather(&gt.q, kd, kh * dk, dk), gather(&gt.k, kd, kh * dk, dk));
            let v = gather(&gt.act, cd, 2 * kd + h * dv, dv);
            let (g, beta) = (gather(&gt.g, nv, h, 1), gather(&gt.beta, nv, h, 1));
            let dout: Vec<T> =
                real.iter().flat_map(|&tok| d_o[(r * t + tok) * vd + h * dv..][..dv].iter().copied()).collect();
            recurrence_backward(&rec.checkpoints[idx], &q, &k, &v, &g, &beta, &dout)
        })
        .collect();

    // Per row: the gates', norms', SiLU's and convolution's backward.
    let neg_a: Vec<T> = p.a_log.iter().map(|&x| T::of(0.0) - x.exp()).collect();
    let scale = T::of(1.0 / (dk as f64).sqrt());
    type RowGrads<T> = (Vec<T>, Vec<T>, Vec<T>, Vec<T>, Vec<T>, Vec<T>);
    let per_row: Vec<RowGrads<T>> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let gt = &row_gates[r];
            let real = &rec.real[r];
            let n = real.len();
            let mut d_act = vec![T::of(0.0); n * cd];
            let (mut da, mut db) = (vec![T::of(0.0); t * nv], vec![T::of(0.0); t * nv]);
            let (mut d_alog, mut d_dt) = (vec![T::of(0.0); nv], vec![T::of(0.0); nv]);
            let mut dqn = vec![T::of(0.0); dk];
            let mut dkn = vec![T::of(0.0); dk];
            for (i, &tok) in real.iter().enumerate() {
                let act = &gt.act[i * cd..(i + 1) * cd];
                let dact = &mut d_act[i * cd..(i + 1) * cd];
                for kh in 0..nk {
                    dqn.fill(T::of(0.0));
                    dkn.fill(T::of(0.0));
                    for h in kh * group..(kh + 1) * group {
                        let hg = &head_grads[r * nv + h];
                        for j in 0..dk {
                            dqn[j] += hg.0[i * dk + j];
                            dkn[j] += hg.1[i * dk + j];
                        }
                    }
                    // y = x·ρ (·scale for q): dx = ρ·dy − x·ρ³·(x·dy).
                    for (off, dy, sc) in [(kh * dk, &dqn, scale), (kd + kh * dk, &dkn, T::of(1.0))] {
                        let x = &act[off..off + dk];
                        let rho = inv_l2(x);
                        let mut xdy = T::of(0.0);
                        for j in 0..dk {
                            xdy += x[j] * dy[j] * sc;
                        }
                        let r3 = rho * rho * rho;
                        for j in 0..dk {
                            dact[off + j] = rho * dy[j] * sc - x[j] * r3 * xdy;
                        }
                    }
                }
                for h in 0..nv {
                    let hg = &head_grads[r * nv + h];
                    dact[2 * kd + h * dv..2 * kd + (h + 1) * dv].copy_from_slice(&hg.2[i * dv..(i + 1) * dv]);
                    let (dg, dbeta) = (hg.3[i], hg.4[i]);
                    let beta = gt.beta[i * nv + h];
                    db[tok * nv + h] = dbeta * beta * (T::of(1.0) - beta);
                    let x = a[(r * t + tok) * nv + h] + p.dt_bias[h];
                    let dx = dg * neg_a[h] * softplus_grad(x);
                    da[tok * nv + h] = dx;
                    d_dt[h] += dx;
                    d_alog[h] += dg * gt.g[i * nv + h];
                }
            }
            // SiLU, then the convolution over [zeros(K−1) | the row's real inputs].
            let y = &rec.y_pre[r * t * cd..(r + 1) * t * cd];
            for (i, &tok) in real.iter().enumerate() {
                for ch in 0..cd {
                    d_act[i * cd + ch] *= silu_grad(y[tok * cd + ch]);
                }
            }
            let u = &qkv[r * t * cd..(r + 1) * t * cd];
            let mut d_u = vec![T::of(0.0); t * cd];
            let mut d_w = vec![T::of(0.0); cd * kk];
            for (i, _) in real.iter().enumerate() {
                for j in 0..kk {
                    // Input index i + j − (K−1) of the real sequence; before it, zeros.
                    let Some(src) = (i + j).checked_sub(kk - 1) else { continue };
                    let ts = real[src];
                    for ch in 0..cd {
                        let g = d_act[i * cd + ch];
                        d_w[ch * kk + j] += g * u[ts * cd + ch];
                        d_u[ts * cd + ch] += g * p.conv[ch * kk + j];
                    }
                }
            }
            (d_u, da, db, d_w, d_alog, d_dt)
        })
        .collect();
    let mut grads = Grads {
        qkv: Vec::with_capacity(rows * t * cd),
        z: dz,
        a: Vec::with_capacity(rows * t * nv),
        b: Vec::with_capacity(rows * t * nv),
        conv: vec![T::of(0.0); cd * kk],
        a_log: vec![T::of(0.0); nv],
        dt_bias: vec![T::of(0.0); nv],
        norm: d_norm,
    };
    for (du, da, db, dw, dal, ddt) in per_row {
        grads.qkv.extend(du);
        grads.a.extend(da);
        grads.b.extend(db);
        for (x, y) in grads.conv.iter_mut().zip(dw) {
            *x += y;
        }
        for (x, y) in grads.a_log.iter_mut().zip(dal) {
            *x += y;
        }
        for (x, y) in grads.dt_bias.iter_mut().zip(ddt) {
            *x += y;
        }
    }
    grads
}

/// A tensor's data as `T` on the host.
fn host<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.to_dtype(T::DTYPE)?.flatten_all()?.to_vec1::<T>()?)
}

impl GatedDeltaNet {
    /// Projections per layer: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj.
    pub const LINEARS: usize = 5;

    /// The layer on candle tensors: x [B, T, hidden] → [B, T, hidden], advancing `state`
    /// (B rows, zeros when None) in place when given. The part between the projections runs on
    /// the host ([`forward`]), so it has no autograd: the CPU tape trains it.
    pub fn forward(
        &self,
        x: &Tensor,
        c: &DeltaNetConfig,
        eps: f64,
        mask: &[Vec<u8>],
        state: Option<&mut Option<StateRows>>,
        adapters: Option<(&RowAdapters, usize)>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (ad, first) = (adapters.map(|a| a.0), adapters.map_or(0, |a| a.1));
        let proj = |lin: &Linear, k: usize| RowAdapters::forward(ad, lin, x, first + k);
        let (qkv, z, pb, pa) = (
            proj(&self.in_proj_qkv, 0)?,
            proj(&self.in_proj_z, 1)?,
            proj(&self.in_proj_b, 2)?,
            proj(&self.in_proj_a, 3)?,
        );
        let dims = Dims { b, t, cfg: *c };
        let out = match x.dtype() {
            DType::F64 => self.host_forward::<f64>([&qkv, &z, &pa, &pb], mask, state, dims, eps)?,
            _ => self.host_forward::<f32>([&qkv, &z, &pa, &pb], mask, state, dims, eps)?,
        };
        let out = out.reshape((b, t, c.value_dim()))?.to_dtype(x.dtype())?.to_device(x.device())?;
        RowAdapters::forward(ad, &self.out_proj, &out, first + 4)
    }

    fn host_forward<T: StateFloat>(
        &self,
        [qkv, z, a, b]: [&Tensor; 4],
        mask: &[Vec<u8>],
        state: Option<&mut Option<StateRows>>,
        dims: Dims,
        eps: f64,
    ) -> Result<Tensor> {
        let sl = state_len(&dims.cfg);
        let mut scratch = vec![];
        let st: &mut Vec<T> = match state {
            Some(slot) => {
                let rows = slot.get_or_insert_with(|| T::wrap(vec![T::of(0.0); dims.b * sl]));
                if rows.len() != dims.b * sl {
                    return Err(Error::input(format!(
                        "DeltaNet state holds {} rows, the batch has {}",
                        rows.num_rows(sl),
                        dims.b
                    )));
                }
                T::rows_mut(rows).ok_or_else(|| Error::input("DeltaNet state of another dtype than the forward"))?
            }
            None => {
                scratch = vec![T::of(0.0); dims.b * sl];
                &mut scratch
            }
        };
        let (conv, a_log, dt_bias, norm) =
            (host::<T>(&self.conv1d)?, host::<T>(&self.a_log)?, host::<T>(&self.dt_bias)?, host::<T>(&self.norm)?);
        let p = Params { conv: &conv, a_log: &a_log, dt_bias: &dt_bias, norm: &norm, eps };
        let (qkv, z, a, b) = (host::<T>(qkv)?, host::<T>(z)?, host::<T>(a)?, host::<T>(b)?);
        let (out, _) = forward(&qkv, &z, &a, &b, &p, mask, st, dims, false);
        Ok(Tensor::from_vec(out, dims.b * dims.t * dims.cfg.value_dim(), &candle_core::Device::Cpu)?)
    }

    /// The projections by their name inside the layer, in adapter-index order.
    pub fn linears_mut(&mut self) -> [(&'static str, &mut Linear); Self::LINEARS] {
        [
            ("linear_attn.in_proj_qkv", &mut self.in_proj_qkv),
            ("linear_attn.in_proj_z", &mut self.in_proj_z),
            ("linear_attn.in_proj_b", &mut self.in_proj_b),
            ("linear_attn.in_proj_a", &mut self.in_proj_a),
            ("linear_attn.out_proj", &mut self.out_proj),
        ]
    }
}
