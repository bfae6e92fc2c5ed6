//! A sparse mixture-of-experts MLP on the tape: the router and the grouped experts of
//! [`crate::model::moe`] (the engine's own routing and summation order), forward and backward.
//!
//! Backward from dy [N, hidden], with each expert's rows kept from the forward:
//! ```text
//! expert e, its token rows:   d(out_e) = w·dy[tok],   dw[tok, slot] = dy[tok]·out_e
//!                             then down, SwiGLU, gate and up as a dense MLP; dx[tok] += dx_e
//! renormalised weights:       ds_j = (dw_j − Σ_i dw_i·w_i) / Σ_i s_i    (ds_j = dw_j without)
//! softmax:                    dl_e = p_e·(dp_e − Σ_f dp_f·p_f),  dp = ds on the chosen experts
//!                             (+ the load-balancing loss's dp)
//! router:                     dx += dl·Wr,  dWr = dlᵀ·x
//! ```
//! The choice itself (which experts) is piecewise constant: no gradient flows through it.

use rayon::prelude::*;

use super::{linear, Grads};
use crate::model::moe::{combine, gather, route, Group, Routing, SparseMoe};
use crate::model::ops::{swiglu, Real};
use crate::Result;

/// What the backward reads.
pub struct TapeRecord<T> {
    pub routing: Routing<T>,
    groups: Vec<Group>,
    experts: Vec<ExpertRecord<T>>,
}

/// One expert's activations over its tokens' rows.
struct ExpertRecord<T> {
    gate: Vec<T>,
    up: Vec<T>,
    act: Vec<T>,
    out: Vec<T>,
}

/// The MLP's output [N, hidden] for x [N, hidden], and the record.
pub fn forward<T: Real>(moe: &SparseMoe, x: &[T], n: usize, hidden: usize) -> Result<(Vec<T>, TapeRecord<T>)> {
    let (logits, _) = linear::forward(&moe.router, x, n)?;
    let routing = route(&logits, moe.num_experts(), moe.top_k, moe.norm_topk_prob);
    moe.record(&routing);
    let groups = routing.groups();
    // Experts side by side; each one's products are row-order independent, so this changes no bit.
    let experts = groups
        .par_iter()
        .zip(&moe.experts)
        .map(|(g, e)| -> Result<ExpertRecord<T>> {
            let ne = g.tokens.len();
            if ne == 0 {
                return Ok(ExpertRecord { gate: vec![], up: vec![], act: vec![], out: vec![] });
            }
            let xe = gather(x, hidden, &g.tokens);
            let (gate, up) =
                rayon::join(|| linear::forward(&e.gate_proj, &xe, ne), || linear::forward(&e.up_proj, &xe, ne));
            let (gate, up) = (gate?.0, up?.0);
            let act = swiglu::forward(&gate, &up);
            let out = linear::forward(&e.down_proj, &act, ne)?.0;
            Ok(ExpertRecord { gate, up, act, out })
        })
        .collect::<Result<Vec<_>>>()?;
    let outs: Vec<&[T]> = experts.iter().map(|r| r.out.as_slice()).collect();
    let y = combine(&routing, &groups, &outs, hidden);
    Ok((y, TapeRecord { routing, groups, experts }))
}

/// The backward from dy [N, hidden]: the gradient of x, with the gradients of the router and
/// the experts pushed into `grads` (zeros for an expert no token chose, as a fused expert tensor
/// would get). `aux_dprobs` [N, E] is an extra gradient of the router's probabilities (the
/// load-balancing loss).
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Real>(
    moe: &SparseMoe,
    rec: &TapeRecord<T>,
    x: &[T],
    dy: &[T],
    n: usize,
    hidden: usize,
    aux_dprobs: Option<&[T]>,
    grads: &mut Grads<T>,
) -> Result<Vec<T>> {
    let Routing { num_experts: ne_all, top_k: k, probs, experts: chosen, weights, chosen_sum } = &rec.routing;
    let (ne_all, k) = (*ne_all, *k);
    let mut dw = vec![T::of(0.0); n * k];
    let mut dx = vec![T::of(0.0); n * hidden];
    for ((g, r), e) in rec.groups.iter().zip(&rec.experts).zip(&moe.experts) {
        let ne = g.tokens.len();
        if ne == 0 {
            for lin in [&e.gate_proj, &e.up_proj, &e.down_proj] {
                if lin.weight.is_variable() {
                    grads.push(&lin.weight, vec![T::of(0.0); lin.weight.elem_count()]);
                }
            }
            continue;
        }
        let mut d_out = Vec::with_capacity(ne * hidden);
        for ((&tok, &slot), row) in g.tokens.iter().zip(&g.slots).zip(r.out.chunks(hidden)) {
            let (tok, at) = (tok as usize, tok as usize * k + slot as usize);
            let d = &dy[tok * hidden..(tok + 1) * hidden];
            let w = weights[at];
            d_out.extend(d.iter().map(|&v| v * w));
            let mut dot = T::of(0.0);
            for (&a, &b) in d.iter().zip(row) {
                dot += a * b;
            }
            dw[at] = dot;
        }
        let mut d_act = None;
        linear::backward(&e.down_proj, &r.act, None, &d_out, ne, &mut d_act, grads)?;
        let d_act = d_act.expect("set by the backward");
        let (mut d_gate, mut d_up) = (vec![T::of(0.0); d_act.len()], vec![T::of(0.0); d_act.len()]);
        swiglu::backward(&r.gate, &r.up, &d_act, &mut d_gate, &mut d_up);
        let xe = gather(x, hidden, &g.tokens);
        let mut dxe = None;
        linear::backward(&e.gate_proj, &xe, None, &d_gate, ne, &mut dxe, grads)?;
        linear::backward(&e.up_proj, &xe, None, &d_up, ne, &mut dxe, grads)?;
        let dxe = dxe.expect("set by the backward");
        for (&tok, row) in g.tokens.iter().zip(dxe.chunks(hidden)) {
            for (a, &v) in dx[tok as usize * hidden..(tok as usize + 1) * hidden].iter_mut().zip(row) {
                *a += v;
            }
        }
    }
    // Through the weights and the softmax to the router logits.
    let mut d_logits = vec![T::of(0.0); n * ne_all];
    for tok in 0..n {
        let p = &probs[tok * ne_all..(tok + 1) * ne_all];
        let mut dp = match aux_dprobs {
            Some(a) => a[tok * ne_all..(tok + 1) * ne_all].to_vec(),
            None => vec![T::of(0.0); ne_all],
        };
        let (sel, w, dwt) =
            (&chosen[tok * k..(tok + 1) * k], &weights[tok * k..(tok + 1) * k], &dw[tok * k..(tok + 1) * k]);
        if moe.norm_topk_prob {
            let mut c = T::of(0.0);
            for (&d, &wj) in dwt.iter().zip(w) {
                c += d * wj;
            }
            for (&x, &d) in sel.iter().zip(dwt) {
                dp[x as usize] += (d - c) / chosen_sum[tok];
            }
        } else {
            for (&x, &d) in sel.iter().zip(dwt) {
                dp[x as usize] += d;
            }
        }
        let mut dot = T::of(0.0);
        for (&a, &b) in dp.iter().zip(p) {
            dot += a * b;
        }
        for ((dl, &pe), &dpe) in d_logits[tok * ne_all..(tok + 1) * ne_all].iter_mut().zip(p).zip(&dp) {
            *dl = pe * (dpe - dot);
        }
    }
    let mut acc = Some(dx);
    linear::backward(&moe.router, x, None, &d_logits, n, &mut acc, grads)?;
    Ok(acc.expect("set above"))
}

/// The load-balancing loss of a forward (transformers' `load_balancing_loss_func` with the
/// attention mask), from every sparse layer's routing over the real tokens:
/// ```text
/// f_e = (tokens routed to e) / R,   P_e = (Σ p_e over tokens) / R,   R = layers · real tokens
/// aux = E · Σ_e f_e · P_e            ∂aux/∂p_{t,e} = E · f_e / R   (f is a count: constant)
/// ```
/// `scale` is the weight the loss carries into the backward (0: none).
pub struct RouterStats {
    counts: Vec<f64>,
    prob_sums: Vec<f64>,
    rows: f64,
    pub scale: f64,
}

impl RouterStats {
    pub fn new(num_experts: usize) -> Self {
        RouterStats { counts: vec![0.0; num_experts], prob_sums: vec![0.0; num_experts], rows: 0.0, scale: 0.0 }
    }

    /// Adds one sparse layer's routing of the tokens whose `real` entry (row-major over the
    /// batch) is nonzero.
    pub fn add<T: Real>(&mut self, routing: &Routing<T>, real: &[u8]) {
        let (e, k) = (routing.num_experts, routing.top_k);
        for (tok, _) in real.iter().enumerate().filter(|(_, &m)| m != 0) {
            for &x in &routing.experts[tok * k..(tok + 1) * k] {
                self.counts[x as usize] += 1.0;
            }
            for (s, &p) in self.prob_sums.iter_mut().zip(&routing.probs[tok * e..(tok + 1) * e]) {
                *s += p.to_f64();
            }
            self.rows += 1.0;
        }
    }

    pub fn loss(&self) -> f64 {
        if self.rows == 0.0 {
            return 0.0;
        }
        let e = self.counts.len() as f64;
        e * self.counts.iter().zip(&self.prob_sums).map(|(c, p)| (c / self.rows) * (p / self.rows)).sum::<f64>()
    }

    /// scale · ∂aux/∂p [N, E] for the tokens of `real` (0 for the others); None without a scale.
    pub fn dprobs<T: Real>(&self, real: &[u8]) -> Option<Vec<T>> {
        if self.scale == 0.0 || self.rows == 0.0 {
            return None;
        }
        let e = self.counts.len();
        let row: Vec<T> =
            self.counts.iter().map(|c| T::of(self.scale * e as f64 * (c / self.rows) / self.rows)).collect();
        let mut out = vec![T::of(0.0); real.len() * e];
        for (chunk, &m) in out.chunks_mut(e).zip(real) {
            if m != 0 {
                chunk.copy_from_slice(&row);
            }
        }
        Some(out)
    }
}
