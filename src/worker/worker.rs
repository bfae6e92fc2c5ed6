//! [`Worker`]: one data-parallel rank — trainable parameters, gradient accumulators, AdamW state.
//!
//! The contract (docs/architecture.md, "The worker contract"):
//! - `forward_backward` adds the gradient of `Σ_datums Σ_t loss_t · w_t` — a plain sum, no
//!   normaliser — to the accumulators, micro-batch by micro-batch and call by call, until
//!   `optim_step`. Splitting the batch differently changes only float rounding.
//! - Metrics are `(sum, count)` pairs merged across micro-batches (exact means); per-datum
//!   records come back in input order, or empty without any host copy when not asked for.
//! - `forward` computes the same outputs without a backward pass.
//! - `optim_step` applies AdamW (see [`super::adamw`]) and zeroes the accumulators.
//! - A bf16 / f16 model trains in mixed precision ([`super::mixed_precision`]): f32 masters and
//!   f32 accumulators beside the half-precision parameters.

use std::sync::Arc;

use candle_core::{Tensor, Var};

use super::adamw::{self, clip_coefficient, global_norm, AdamParams, Moments};
use super::adamw_fused;
use super::batch::{validate_batch, Datum, LossFnOutput, Requirements};
use super::gradient_sum::{add_sum, agree_on_rounds};
use super::head_stream::SharedHeadStream;
use super::loss_fn::{needs_entropy, requirements};
use super::micro_batch::{apply_loss, model_outputs, router_aux_loss, split, HeadOptions};
use super::mixed_precision::{keeps_masters, masters_of, widened, MASTER_DTYPE};
use super::packing::plan_micro_batches;
use super::rng::WorkerRng;
use super::sharded_step::RankExchange;
use super::sharding::ShardPlan;
use super::unit_reduce::UnitReduce;
use super::value_head::ValueHead;
use super::weight_slices::WeightSlices;
use super::worker_config::WorkerConfig;
use crate::algo::{Loss, Metrics};
use crate::model::graph_checkpoint::GraphCheckpoint;
use crate::model::sharded_weights::{self, forward_units, UnitGather};
use crate::model::tape::{self, HeadSink, Keep, Tape};
use crate::model::{lora, SamplerWeights, Transformer};
use crate::{Error, Result};

/// What `forward_backward` and `forward` return.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ForwardBackwardOutput {
    /// `name:reduction` → (sum, count); reduce with [`Metrics::reduce`].
    pub metrics: Metrics,
    /// One record per datum, in input order.
    pub loss_fn_outputs: Vec<LossFnOutput>,
}

pub struct Worker {
    pub(super) model: Transformer,
    pub(super) config: WorkerConfig,
    /// Trainable variables by name: the base weights (HF names) or the LoRA adapters (PEFT
    /// names), then the value head. The model holds the same storage.
    pub(super) params: Vec<(String, Var)>,
    pub(super) value_head: Option<ValueHead>,
    /// Accumulated gradient per parameter; `None` = no gradient since the last step.
    pub(super) grads: Vec<Option<Tensor>>,
    /// AdamW moments per parameter, created at its first update.
    pub(super) moments: Vec<Option<Moments>>,
    /// Mixed precision: the f32 master of each parameter (the parameter is its rounding), and
    /// the accumulators are f32; `None` for a parameter another rank owns (sharding). `None`
    /// as a whole: the parameters are their own masters.
    pub(super) masters: Option<Vec<Option<Tensor>>>,
    /// Sharded: the parameters this rank owns, the only ones it keeps optimizer state for and
    /// updates ([`super::sharded_step`]). `None`: it updates every parameter.
    pub(super) shard: Option<ShardPlan>,
    /// `full` sharding: the base weights this rank keeps, and how the others are gathered
    /// ([`super::weight_slices`]; the model's weight gate is the same object).
    pub(super) slices: Option<Arc<WeightSlices>>,
    /// `full`: the gradients of this step (or, summing each micro-batch, of this round) summed
    /// to their owners during its backward (`worker/unit_reduce.rs`).
    pub(super) unit_reduce: Option<UnitReduce>,
    /// The group's collectives, for the sums of each micro-batch (`gradient_sum.rs`); `None`: a
    /// worker alone.
    pub(super) exchange: Option<Arc<dyn RankExchange>>,
    /// The accumulators hold the ranks' sums, not this rank's own gradients.
    pub(super) summed: bool,
    /// Optimizer steps applied.
    pub(super) step: u64,
    pub(super) rng: WorkerRng,
    /// Parameters, gradients and moments are in host memory ([`super::placement`]).
    pub(super) offloaded: bool,
}

impl Worker {
    /// A worker training `model` as `config` says: LoRA adapters are attached (fresh) or every
    /// base weight becomes trainable; a critic gets a fresh value head.
    pub fn new(mut model: Transformer, config: WorkerConfig) -> Result<Self> {
        if let Some(cfg) = &config.lora {
            cfg.validate()?;
        }
        plan_micro_batches(&[1], config.micro_batch_size, config.max_tokens_per_microbatch)?;
        if !(config.temperature.is_finite() && config.temperature > 0.0) {
            return Err(Error::input(format!(
                "temperature: the log-probs' temperature must be finite and positive, not {}",
                config.temperature
            )));
        }
        if config.router_aux_loss_coef != 0.0 && model.config.moe.is_none() {
            return Err(Error::input(format!(
                "router_aux_loss_coef: a {} model has no experts (the load-balancing loss is Qwen3-MoE's)",
                model.config.arch.model_type()
            )));
        }
        let mut rng = WorkerRng::new(config.seed);
        let mut params = match &config.lora {
            Some(cfg) => lora::attach_new(&mut model, cfg, rng.next_seed())?,
            None => model.make_trainable()?,
        };
        let value_head = if config.critic {
            let head = ValueHead::new(&mut rng.fork(), model.config.hidden_size, model.dtype, &model.device)?;
            params.extend(head.vars());
            Some(head)
        } else {
            None
        };
        let n = params.len();
        let masters = if keeps_masters(model.dtype, &config) {
            Some(masters_of(&params)?.into_iter().map(Some).collect())
        } else {
            None
        };
        Ok(Worker {
            model,
            config,
            params,
            value_head,
            grads: vec![None; n],
            moments: vec![None; n],
            masters,
            shard: None,
            slices: None,
            unit_reduce: None,
            exchange: None,
            summed: false,
            step: 0,
            rng,
            offloaded: false,
        })
    }

    pub fn model(&self) -> &Transformer {
        &self.model
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Trainable variables by name (setting one changes the model).
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The accumulated gradient of each trainable parameter (`None`: none since the last step).
    pub fn gradients(&self) -> Vec<(&str, Option<&Tensor>)> {
        self.params.iter().zip(&self.grads).map(|((n, _), g)| (n.as_str(), g.as_ref())).collect()
    }

    /// AdamW moments of a parameter, once it has been updated.
    pub fn moments(&self, name: &str) -> Option<&Moments> {
        let i = self.params.iter().position(|(n, _)| n == name)?;
        self.moments[i].as_ref()
    }

    /// The f32 master weights by parameter (mixed precision), in [`Worker::params`] order
    /// (`None` for a parameter another rank owns); `None` as a whole when the parameters are
    /// their own masters (an f32 model, or `master_weights` off).
    pub fn master_weights(&self) -> Option<&[Option<Tensor>]> {
        self.masters.as_deref()
    }

    /// The parameters this rank owns under sharding (`None`: unsharded, it updates them all).
    pub fn shard_plan(&self) -> Option<&ShardPlan> {
        self.shard.as_ref()
    }

    /// Optimizer steps applied so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The worker's random stream state `(seed, draws)`.
    pub fn rng_state(&self) -> (u64, u64) {
        (self.rng.seed, self.rng.draws)
    }

    pub fn value_head(&self) -> Option<&ValueHead> {
        self.value_head.as_ref()
    }

    /// A private snapshot of the weights an engine needs — the LoRA adapters for a LoRA
    /// policy, every base parameter otherwise — versioned by the optimizer steps applied.
    pub fn sampler_weights(&self) -> Result<SamplerWeights> {
        self.check_resident()?;
        self.check_weights_whole("sampler weights")?;
        SamplerWeights::snapshot(&self.model, self.config.lora.as_ref(), self.step)
    }

    /// Drops the accumulated gradients.
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = None);
        self.unit_reduce = None;
        self.summed = false;
    }

    /// Adds the gradient of `loss` (see [`super::loss_fn`]) over `batch` to the accumulators
    /// and returns the metrics and, with `return_per_token_outputs`, per-datum `logprobs` (or
    /// `values`) and `elementwise_loss`. Takes the same arguments as [`Worker::forward`]; a
    /// backward needs a loss, so `None` is an error here.
    pub fn forward_backward(
        &mut self,
        batch: &[Datum],
        loss: Option<&Loss>,
        return_per_token_outputs: bool,
    ) -> Result<ForwardBackwardOutput> {
        self.run_backward(batch, loss, return_per_token_outputs, false)
    }

    /// [`Worker::forward_backward`] whose gradients the next call, [`Worker::optim_step_sharded`],
    /// applies (no other `forward_backward` in between). Under `full` sharding, when every rank
    /// runs one micro-batch and holds no earlier gradients, each weight's gradient is summed to
    /// its owner during the backward (`worker/unit_reduce.rs`), so no rank holds every gradient;
    /// otherwise, and in every other mode, it is [`Worker::forward_backward`].
    pub fn forward_backward_for_step(
        &mut self,
        batch: &[Datum],
        loss: Option<&Loss>,
        return_per_token_outputs: bool,
    ) -> Result<ForwardBackwardOutput> {
        self.run_backward(batch, loss, return_per_token_outputs, true)
    }

    /// [`Worker::run`] with a backward, which needs a loss.
    fn run_backward(
        &mut self,
        batch: &[Datum],
        loss: Option<&Loss>,
        outputs: bool,
        step_next: bool,
    ) -> Result<ForwardBackwardOutput> {
        let loss = loss.ok_or_else(|| Error::input("forward_backward needs a loss to differentiate"))?;
        self.run(batch, Some(loss), true, outputs, step_next)
    }

    /// Per-datum log-probs (values for a critic) without gradients; with a loss, also its
    /// metrics and `elementwise_loss`.
    pub fn forward(
        &mut self,
        batch: &[Datum],
        loss: Option<&Loss>,
        return_per_token_outputs: bool,
    ) -> Result<ForwardBackwardOutput> {
        let mut out = self.run(batch, loss, false, return_per_token_outputs, false)?;
        // A policy's scoring forward of sampled sequences (RL's): with experts, also how many
        // sampled tokens the sampler routed otherwise (a second pass over the batch).
        if loss.is_none() && self.model.config.moe.is_some() && self.value_head.is_none() && self.slices.is_none() {
            out.metrics.add_sum("router_mismatch", super::micro_batch::router_mismatch(&self.model, batch)? as f64);
        }
        Ok(out)
    }

    /// `step_next`: the caller's next call is the optimizer step (see
    /// [`Worker::forward_backward_for_step`]).
    fn run(
        &mut self,
        batch: &[Datum],
        loss: Option<&Loss>,
        backward: bool,
        outputs: bool,
        step_next: bool,
    ) -> Result<ForwardBackwardOutput> {
        if backward && self.unit_reduce.is_some() {
            return Err(Error::input(
                "the last forward_backward_for_step's gradients are already summed across ranks: the optimizer \
                 step must come before another forward_backward",
            ));
        }
        if backward && self.sums_each_micro_batch() {
            return self.run_summing_each(batch, loss, outputs);
        }
        let Some(slices) = self.slices.clone() else {
            return self.run_micro_batches(batch, loss, backward, outputs, 0, None);
        };
        // Sliced weights: every rank runs as many forwards (and backwards) as the busiest one.
        let pending = self.grads.iter().any(Option::is_some);
        let mine = self.micro_batch_count(batch, loss).map(|n| (n, pending)).map_err(|e| e.to_string());
        let (most, any_pending) = slices.agree(mine)?;
        if backward && step_next && most == 1 && !any_pending {
            self.start_unit_reduce(None)?;
        }
        let out = self.run_micro_batches(batch, loss, backward, outputs, most, None);
        if let Err(e) = &out {
            slices.abort(&format!("a data-parallel rank failed: {e}"));
        }
        out
    }

    /// A backward under `gradient_sum = "micro_batch"` (`gradient_sum.rs`): every rank runs as
    /// many rounds as the busiest one has micro-batches, and each round's gradients are summed
    /// across the ranks into the sums this rank keeps.
    fn run_summing_each(
        &mut self,
        batch: &[Datum],
        loss: Option<&Loss>,
        outputs: bool,
    ) -> Result<ForwardBackwardOutput> {
        let ex = self.round_exchange()?;
        let mine = self.micro_batch_count(batch, loss).map_err(|e| e.to_string());
        let rounds = match (&self.slices, &ex) {
            (Some(slices), _) => slices.agree(mine.map(|n| (n, false)))?.0,
            (None, Some(ex)) => agree_on_rounds(&**ex, mine)?,
            (None, None) => mine.map_err(Error::input)?,
        };
        let mut sums = self.start_summing_call()?;
        let out = self.run_micro_batches(batch, loss, true, outputs, rounds, Some(&mut sums));
        self.end_summing_call(sums, rounds);
        if let (Err(e), Some(ex)) = (&out, &ex) {
            ex.abort(&format!("a data-parallel rank failed: {e}"));
        }
        out
    }

    /// The number of micro-batches [`Worker::run_micro_batches`] would split `batch` into, or why
    /// it refuses it.
    fn micro_batch_count(&self, batch: &[Datum], loss: Option<&Loss>) -> Result<usize> {
        self.check_batch(batch, loss)?;
        let lengths: Vec<usize> = batch.iter().map(Datum::len).collect();
        Ok(plan_micro_batches(&lengths, self.config.micro_batch_size, self.config.max_tokens_per_microbatch)?.len())
    }

    /// What [`Worker::run_micro_batches`] refuses: a loss that does not fit the worker, a batch
    /// that does not fit the loss.
    fn check_batch(&self, batch: &[Datum], loss: Option<&Loss>) -> Result<()> {
        self.check_resident()?;
        let critic = self.value_head.is_some();
        if let Some(loss) = loss {
            let is_value = matches!(loss, Loss::Value(_));
            if is_value != critic {
                return Err(Error::input(if critic {
                    format!("loss `{}`: this worker is a critic and trains only with the `value` loss", loss.name())
                } else {
                    "loss `value` needs a critic worker (WorkerConfig::critic)".to_string()
                }));
            }
        }
        let needs = match loss {
            Some(loss) => requirements(loss),
            None => Requirements { target_tokens: !critic, floats: vec![] },
        };
        validate_batch(batch, self.model.config.vocab_size, &needs)
    }

    /// The micro-batches of `batch`, run (and differentiated when `backward`), then
    /// `lockstep − count` rounds without data, so that every rank of the group takes part in
    /// the same collectives: with sliced weights, walks of the units that gather them. With
    /// `sums`, each round's gradients are summed across the ranks into them
    /// ([`Worker::end_round`]).
    fn run_micro_batches(
        &mut self,
        batch: &[Datum],
        loss: Option<&Loss>,
        backward: bool,
        outputs: bool,
        lockstep: usize,
        mut sums: Option<&mut Vec<Option<Tensor>>>,
    ) -> Result<ForwardBackwardOutput> {
        self.check_batch(batch, loss)?;
        let critic = self.value_head.is_some();
        let lengths: Vec<usize> = batch.iter().map(Datum::len).collect();
        let plan = plan_micro_batches(&lengths, self.config.micro_batch_size, self.config.max_tokens_per_microbatch)?;
        let entropy = loss.is_some_and(needs_entropy);
        let keep = match (backward, self.config.activation_checkpointing) {
            (false, _) => Keep::Nothing,
            (true, false) => Keep::Everything,
            (true, true) => Keep::LayerInputs,
        };

        let mut metrics = Metrics::new();
        let mut records = vec![LossFnOutput::default(); batch.len()];
        for round in 0..plan.len().max(lockstep) {
            if let Some(sums) = sums.as_deref_mut() {
                self.start_round(sums)?;
            }
            if let Some(members) = plan.get(round) {
                let head = HeadOptions { entropy, inv_temperature: 1.0 / self.config.temperature };
                let mut out = model_outputs(&self.model, self.value_head.as_ref(), batch, members, head, keep)?;
                if let (true, Some(tape)) = (backward && loss.is_some(), out.tape.as_mut()) {
                    router_aux_loss(tape, batch, members, self.config.router_aux_loss_coef, &mut metrics);
                }
                let mut elementwise = None;
                if let Some(loss) = loss {
                    let (loss_out, weights) = apply_loss(loss, &out, batch, members)?;
                    metrics.merge(&loss_out.metrics);
                    if backward {
                        self.accumulate(&loss_out.weighted_sum, out.tape.take(), out.graph.take())?;
                    }
                    if outputs {
                        elementwise = Some((loss_out.per_token_loss.detach() * weights)?);
                    }
                }
                if outputs {
                    let main = split(out.main.detach().to_dtype(candle_core::DType::F32)?.to_vec1()?, &out.lengths);
                    let elementwise = match elementwise {
                        Some(e) => split(e.to_dtype(candle_core::DType::F32)?.to_vec1()?, &out.lengths),
                        None => vec![vec![]; members.len()],
                    };
                    for ((&i, main), elementwise) in members.iter().zip(main).zip(elementwise) {
                        let record = &mut records[i];
                        if critic {
                            record.values = main;
                        } else {
                            record.logprobs = main;
                        }
                        record.elementwise_loss = elementwise;
                    }
                }
            } else if let Some(slices) = self.slices.clone() {
                let layers = self.model.layers.len();
                sharded_weights::walk(&*slices, &forward_units(layers))?;
                if backward {
                    tape::walk_backward(Some(&*slices), layers, &mut |unit, _| self.unit_done(unit))?;
                }
            }
            if let Some(sums) = sums.as_deref_mut() {
                self.end_round(sums)?;
            }
        }
        Ok(ForwardBackwardOutput { metrics, loss_fn_outputs: records })
    }

    /// Backward of `weighted_sum` (and of the model's tape, when it ran on one); adds each
    /// parameter's gradient to its accumulator: candle's part first, then the tape's unit by unit
    /// as its backward produces them (a tied embedding gets one part from each side, the head's
    /// and the gather's, added in that order). A checkpointed graph forward (`graph`) hands its
    /// blocks' gradients after candle's own.
    fn accumulate(&mut self, weighted_sum: &Tensor, tape: Option<Tape>, graph: Option<GraphCheckpoint>) -> Result<()> {
        let store = weighted_sum.backward()?;
        let index_of: std::collections::HashMap<_, usize> =
            self.params.iter().enumerate().map(|(i, (_, v))| (v.as_tensor().id(), i)).collect();
        if let Some(graph) = graph {
            let params: Vec<Tensor> = self.params.iter().map(|(_, v)| v.as_tensor().clone()).collect();
            for (p, g) in graph.backward(&store, &params)? {
                if let Some(&i) = index_of.get(&p.id()) {
                    self.add_gradient(i, &g)?;
                }
            }
            return Ok(());
        }
        for i in 0..self.params.len() {
            if let Some(g) = store.get(self.params[i].1.as_tensor()) {
                self.add_gradient(i, g)?;
            }
        }
        let Some(tape) = tape else { return Ok(()) };
        let mut head =
            self.unit_reduce.as_ref().and_then(|s| s.head.as_ref()).map(|(_, h)| SharedHeadStream(h.clone()));
        tape.backward_by_unit(
            &store,
            &mut |unit, grads| {
                for (p, g) in grads {
                    if let Some(&i) = index_of.get(&p.id()) {
                        self.add_gradient(i, &g)?;
                    }
                }
                self.unit_done(unit)
            },
            head.as_mut().map(|h| h as &mut dyn HeadSink),
        )
    }

    /// The dtype of parameter `i`'s gradient accumulator: the parameter's, f32 under mixed
    /// precision.
    pub(super) fn accumulator_dtype(&self, i: usize) -> candle_core::DType {
        if self.masters.is_some() {
            MASTER_DTYPE
        } else {
            self.params[i].1.dtype()
        }
    }

    /// Adds `g` to parameter `i`'s accumulator.
    fn add_gradient(&mut self, i: usize, g: &Tensor) -> Result<()> {
        self.check_not_summed(i)?;
        // Mixed precision: sums of many bf16 gradients lose their small terms; add in f32.
        // (The tape's gradients of a bf16 model are f32 already.)
        let g = match self.accumulator_dtype(i) {
            MASTER_DTYPE => widened(g)?,
            dtype => g.to_dtype(dtype)?,
        };
        // An accumulator is the first part itself, whose storage nothing else keeps past the
        // backward; later parts are added into it.
        add_sum(&mut self.grads[i], g, true)
    }

    /// One AdamW step on the accumulated gradients; returns the global gradient norm before
    /// clipping. A non-finite norm skips the update (nothing changes but the gradients, which
    /// are dropped). The accumulators are zeroed either way.
    pub fn optim_step(&mut self, params: &AdamParams) -> Result<f64> {
        params.validate()?;
        self.check_resident()?;
        let present: Vec<&Tensor> = self.grads.iter().flatten().collect();
        let norm = global_norm(&present)?;
        if !norm.is_finite() {
            self.zero_grad();
            return Ok(norm);
        }
        let coef = clip_coefficient(norm, params.grad_clip_norm);
        for i in 0..self.params.len() {
            if let Some(grad) = self.grads[i].take() {
                self.update_param(i, grad, coef, params)?;
            }
        }
        self.step += 1;
        self.zero_grad();
        Ok(norm)
    }

    /// AdamW on parameter `i` with its summed gradient times the clip coefficient `coef`.
    pub(super) fn update_param(&mut self, i: usize, grad: Tensor, coef: f64, params: &AdamParams) -> Result<()> {
        let var = &self.params[i].1;
        if self.moments[i].is_none() {
            self.moments[i] = Some(Moments::zeros(var.as_tensor())?);
        }
        let state = self.moments[i].as_mut().expect("just set");
        // On CUDA a master copy takes the one-pass kernels (candle's primitive step is a dozen
        // passes over it); on the CPU the primitive step keeps the bits pinned elsewhere.
        let fused_master = self.masters.as_ref().and_then(|m| m[i].as_ref()).is_some_and(|master| {
            master.device().is_cuda() && adamw_fused::applies(master, state) && grad.dtype() == master.dtype()
        });
        let grad = if coef < 1.0 && !fused_master { (grad * coef)? } else { grad };
        match self.masters.as_mut() {
            Some(masters) => {
                let master = masters[i]
                    .as_mut()
                    .ok_or_else(|| Error::Other(format!("no master weight of `{}` on this rank", self.params[i].0)))?;
                if fused_master {
                    adamw_fused::update(master, &grad, coef.min(1.0), state, params)?;
                } else {
                    *master = adamw::step_value(master, &grad, state, params)?;
                }
                adamw_fused::round_into(var, master)?;
            }
            None => adamw::update(var, &grad, state, params)?,
        }
        Ok(())
    }
}
