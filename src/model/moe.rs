//! Qwen3-MoE's sparse MLP: a router and `num_experts` SwiGLU experts, of which each token uses
//! its top k.
//!
//! ```text
//! p      = softmax(x·Wrᵀ)                     per token, over the experts (f32, f64 for f64)
//! e₁..e_k = the k largest p                   ties to the lowest expert index
//! w_j    = p[e_j] / Σ_i p[e_i]                (plain p[e_j] without norm_topk_prob)
//! y      = Σ_j w_j · down_e(silu(gate_e(x)) ⊙ up_e(x))   e = e_j, summed in expert order
//! ```
//! Experts run as grouped products: the tokens routed to an expert are gathered in token order
//! and go through its projections together, and each token's output adds its experts' rows in
//! ascending expert order, from zero. Every product's order is fixed per row
//! ([`super::ops::matmul_wt`]), so a token's output does not depend on which tokens share its
//! batch or on the thread count: the engine's decode ([`SparseMoe::forward`]) and the trainer's
//! tape (`model::tape::moe`) share [`route`] and [`combine`] and give the same bits, hence the
//! same experts per token.
//!
//! The forward here serves inference only (the engine, scoring): routing is a host computation
//! with no candle graph, so training runs on the CPU tape, whose backward carries the gradient
//! through the renormalised top-k weights into the router.
//!
//! [`router_mismatch`] counts the tokens whose experts differ between the two paths: a
//! [`RouteLog`] on a copy of the model records each sparse layer's choice, once through the
//! engine's prefill (a cached forward, the fused attention a sampler runs) and once through the
//! tape.

use std::sync::{Arc, Mutex};

use candle_core::{Tensor, WithDType};

use super::linear::Linear;
use super::ops::{self, Real};
use super::transformer::{FeedForward, Mlp, Transformer};
use crate::locks::lock;
use crate::Result;

/// Each forward's choices, appended by every sparse layer it passes: per layer call, each row's
/// experts in ascending order.
pub type RouteLog = Arc<Mutex<Vec<Vec<Vec<u32>>>>>;

/// One sparse MLP's parameters: the router (`mlp.gate`, [num_experts, hidden]) and the experts
/// (`mlp.experts.{e}.{gate,up,down}_proj`).
#[derive(Debug, Clone)]
pub struct SparseMoe {
    pub router: Linear,
    pub experts: Vec<Mlp>,
    /// k of the top-k.
    pub top_k: usize,
    pub norm_topk_prob: bool,
    /// Where this layer records its choices, when set ([`router_mismatch`]).
    pub log: Option<RouteLog>,
}

/// Each token's choice: the router's probabilities, its k experts and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing<T> {
    pub num_experts: usize,
    pub top_k: usize,
    /// [N, E] softmax of the router logits.
    pub probs: Vec<T>,
    /// [N, k] chosen experts, largest probability first.
    pub experts: Vec<u32>,
    /// [N, k] their weights (renormalised with `norm_topk_prob`).
    pub weights: Vec<T>,
    /// \[N\] Σ of the chosen probabilities (the renormalisation's divisor).
    pub chosen_sum: Vec<T>,
}

/// The tokens one expert serves: token indices in increasing order, and for each the position
/// (0..k) of this expert among the token's choices.
#[derive(Debug, Clone, Default)]
pub struct Group {
    pub tokens: Vec<u32>,
    pub slots: Vec<u32>,
}

/// Routes N tokens from their router logits [N, E] (see the module docs).
pub fn route<T: Real>(logits: &[T], num_experts: usize, top_k: usize, norm: bool) -> Routing<T> {
    let e = num_experts;
    let n = logits.len() / e;
    let mut probs = vec![T::of(0.0); n * e];
    let mut experts = Vec::with_capacity(n * top_k);
    let mut weights = Vec::with_capacity(n * top_k);
    let mut chosen_sum = Vec::with_capacity(n);
    for (l, p) in logits.chunks(e).zip(probs.chunks_mut(e)) {
        let max = l.iter().fold(T::neg_infinity(), |m, &x| m.fmax(x));
        let mut total = T::of(0.0);
        for (p, &x) in p.iter_mut().zip(l) {
            *p = (x - max).exp();
            total += *p;
        }
        for p in p.iter_mut() {
            *p /= total;
        }
        // Selection by repeated arg-max: strict comparison keeps the lowest index among equals.
        let first = experts.len();
        for _ in 0..top_k {
            let mut best: Option<usize> = None;
            for (i, &pi) in p.iter().enumerate() {
                if experts[first..].contains(&(i as u32)) {
                    continue;
                }
                if best.is_none_or(|b| pi > p[b]) {
                    best = Some(i);
                }
            }
            experts.push(best.expect("top_k ≤ num_experts") as u32);
        }
        let mut sum = T::of(0.0);
        for &x in &experts[first..] {
            sum += p[x as usize];
        }
        for &x in &experts[first..] {
            weights.push(if norm { p[x as usize] / sum } else { p[x as usize] });
        }
        chosen_sum.push(sum);
    }
    Routing { num_experts, top_k, probs, experts, weights, chosen_sum }
}

impl<T: Real> Routing<T> {
    /// The tokens of each expert, in token order.
    pub fn groups(&self) -> Vec<Group> {
        let mut groups = vec![Group::default(); self.num_experts];
        for (tok, chosen) in self.experts.chunks(self.top_k).enumerate() {
            for (slot, &x) in chosen.iter().enumerate() {
                groups[x as usize].tokens.push(tok as u32);
                groups[x as usize].slots.push(slot as u32);
            }
        }
        groups
    }

    /// Each token's experts in ascending order (what [`combine`] sums in, and what
    /// `router_mismatch` compares).
    pub fn sorted_experts(&self) -> Vec<Vec<u32>> {
        self.experts
            .chunks(self.top_k)
            .map(|c| {
                let mut c = c.to_vec();
                c.sort_unstable();
                c
            })
            .collect()
    }
}

/// Rows `tokens` of x [N, width], in that order.
pub fn gather<T: Copy>(x: &[T], width: usize, tokens: &[u32]) -> Vec<T> {
    let mut out = Vec::with_capacity(tokens.len() * width);
    for &t in tokens {
        out.extend_from_slice(&x[t as usize * width..(t as usize + 1) * width]);
    }
    out
}

/// y [N, width] = Σ over experts in ascending order of w · (its output row), from zero; `outs[e]`
/// holds expert e's rows for its group's tokens.
pub fn combine<T: Real, O: AsRef<[T]>>(routing: &Routing<T>, groups: &[Group], outs: &[O], width: usize) -> Vec<T> {
    let n = routing.experts.len() / routing.top_k;
    let mut y = vec![T::of(0.0); n * width];
    for (g, out) in groups.iter().zip(outs) {
        for ((&tok, &slot), row) in g.tokens.iter().zip(&g.slots).zip(out.as_ref().chunks(width)) {
            let w = routing.weights[tok as usize * routing.top_k + slot as usize];
            for (acc, &v) in y[tok as usize * width..(tok as usize + 1) * width].iter_mut().zip(row) {
                *acc += w * v;
            }
        }
    }
    y
}

impl SparseMoe {
    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }

    /// The MLP's output for x [..., hidden] (no gradient: see the module docs), and the routing.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let hidden = *dims.last().expect("an MLP input has a hidden dimension");
        let x2 = x.reshape(((), hidden))?.detach();
        let y = match ops::norm_dtype(x.dtype()) {
            candle_core::DType::F64 => self.forward_rows::<f64>(&x2)?,
            _ => self.forward_rows::<f32>(&x2)?,
        };
        Ok(y.to_dtype(x.dtype())?.reshape(dims)?)
    }

    /// The experts each row of x [N, hidden] is routed to, ascending (a decode step's choice).
    pub fn choose(&self, x: &Tensor) -> Result<Vec<Vec<u32>>> {
        let hidden = *x.dims().last().expect("an MLP input has a hidden dimension");
        let x2 = x.reshape(((), hidden))?.detach();
        Ok(match ops::norm_dtype(x.dtype()) {
            candle_core::DType::F64 => self.routing::<f64>(&x2)?.sorted_experts(),
            _ => self.routing::<f32>(&x2)?.sorted_experts(),
        })
    }

    /// Appends this call's choices to the layer's log, if it has one.
    pub(crate) fn record<T: Real>(&self, routing: &Routing<T>) {
        if let Some(log) = &self.log {
            lock(log).push(routing.sorted_experts());
        }
    }

    fn routing<T: Real + WithDType>(&self, x: &Tensor) -> Result<Routing<T>> {
        let logits = self.router.forward(x)?.to_dtype(T::DTYPE)?.flatten_all()?.to_vec1::<T>()?;
        Ok(route(&logits, self.num_experts(), self.top_k, self.norm_topk_prob))
    }

    fn forward_rows<T: Real + WithDType>(&self, x: &Tensor) -> Result<Tensor> {
        let (n, hidden) = x.dims2()?;
        let routing = self.routing::<T>(x)?;
        self.record(&routing);
        let groups = routing.groups();
        let mut outs = Vec::with_capacity(groups.len());
        for (g, e) in groups.iter().zip(&self.experts) {
            if g.tokens.is_empty() {
                outs.push(vec![]);
                continue;
            }
            let idx = Tensor::from_slice(&g.tokens, g.tokens.len(), x.device())?;
            let xe = x.index_select(&idx, 0)?;
            let act = ops::swiglu::swiglu(&e.gate_proj.forward(&xe)?, &e.up_proj.forward(&xe)?)?;
            let y = e.down_proj.forward(&act)?;
            outs.push(y.to_dtype(T::DTYPE)?.flatten_all()?.to_vec1::<T>()?);
        }
        let y = combine(&routing, &groups, &outs, hidden);
        Ok(Tensor::from_vec(y, (n, hidden), x.device())?)
    }
}

/// `model` with one fresh log on every sparse layer.
fn logged(model: &Transformer) -> (Transformer, RouteLog) {
    let log = RouteLog::default();
    let mut m = model.clone();
    for layer in &mut m.layers {
        if let FeedForward::Sparse(moe) = &mut layer.mlp {
            moe.log = Some(log.clone());
        }
    }
    (m, log)
}

/// The number of tokens with a nonzero `weights` entry (one per token of `input_ids`) whose
/// experts, in any sparse layer, differ between the sampler's forward (the engine's prefill over
/// a fresh cache) and the trainer's (the tape); 0 for a model without experts.
pub fn router_mismatch(
    model: &Transformer,
    input_ids: &[Vec<u32>],
    positions: &[Vec<u32>],
    mask: &[Vec<u8>],
    weights: &[Vec<f32>],
) -> Result<usize> {
    if model.config.moe.is_none() {
        return Ok(0);
    }
    let (sampler, sampler_log) = logged(model);
    let mut cache = sampler.new_cache();
    sampler.forward_hidden(input_ids, positions, mask, Some(&mut cache))?;
    let (trainer, trainer_log) = logged(model);
    super::tape::Tape::forward(&trainer, input_ids, positions, mask, false)?;
    let (s, t) = (lock(&sampler_log), lock(&trainer_log));
    let width = input_ids.first().map_or(0, Vec::len);
    count_mismatches(&s, &t, weights, width)
}

/// Tokens with a nonzero weight (`weights` \[B\]\[T\], `width` = T) whose experts differ in any layer
/// between two route logs of the same batch (each layer's entry [B·T] rows).
pub fn count_mismatches(
    sampler: &[Vec<Vec<u32>>],
    trainer: &[Vec<Vec<u32>>],
    weights: &[Vec<f32>],
    width: usize,
) -> Result<usize> {
    if sampler.len() != trainer.len() {
        return Err(crate::Error::Other(format!(
            "router_mismatch: {} sparse layers vs {}",
            sampler.len(),
            trainer.len()
        )));
    }
    let mut count = 0;
    for (row, w) in weights.iter().enumerate() {
        for (i, &wi) in w.iter().enumerate() {
            let at = row * width + i;
            if wi != 0.0 && sampler.iter().zip(trainer).any(|(a, b)| a.get(at) != b.get(at)) {
                count += 1;
            }
        }
    }
    Ok(count)
}
