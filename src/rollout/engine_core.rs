//! The sampling engine: continuous batching over the model's KV-cache decode, driven one step
//! at a time by its owner (a test, the CLI, or the [`super::engine::Engine`] thread).
//!
//! ```text
//! step():  admit waiting requests while the batch and the KV budget allow:
//!            prefill prompt[..L-1] (super::prefill: the prompts admitted together in one forward
//!            per prompt length, without padding; once for all samples of a prompt and for
//!            identical prompts), fan the cache row out to the n samples, and append the rows
//!            to the running cache with left padding;
//!          one batched forward of each row's pending token (the last prompt token, then the
//!            last sampled one) at its own position;
//!          sample each row with its own seeded stream; finished rows leave the cache by row
//!            selection, and columns that only they used are trimmed.
//! ```
//! Because a new request's prompt is prefilled without padding and each row samples from its
//! own stream, a seeded
//! request gives the same tokens and log-prob bits whatever else is running: every kernel sums
//! in one order whatever the batch (`model::ops::matmul_wt`, `cached_attention`).
//!
//! Admission and the KV budget are the [`super::scheduler`]'s: FIFO, while rows × the longest
//! final length stays within `kv_cache_tokens`; a request that could not fit even alone is
//! refused at `add_request`.
//!
//! Weight updates ([`EngineCore::update_weights`]) land between steps. Rows running or frozen by
//! a `keep` pause carry on in the same batch position with their own random streams, but their
//! KV caches are recomputed under the new weights first: each row's prompt + tokens so far is
//! prefilled again (the admission path; identical prefixes share one prefill) and the batched
//! cache is rebuilt in the same row order. Why: the trainer scores a sample with one forward of
//! the weights of each token's version over the whole prefix, and the off-policy corrections
//! (`rollout_is`, TIS, `cispo` anchored on the rollout) take the sampler's log-probs to be
//! exactly those. With the old keys and values kept, a token sampled after the update would come
//! from neither policy. So every token carries the version of the weights that sampled it and a
//! log-prob equal to a full forward of those weights over the same prefix, whether the update
//! found the request running (`keep`) or the request was aborted and continued by the client
//! (`abort`: its continuation is prefilled the same way). The versions change once per update,
//! where it landed. The cost is one prefill per running row and update, about what admitting the
//! rows anew costs. The old cache is dropped first and the rebuilt one is no wider (each row's
//! length is unchanged and all-padding columns go), so the KV budget holds. Prompt log-probs are
//! not recomputed: they stay those of the weights that admitted the request (the version of its
//! first token), in both modes.
//!
//! LoRA adapters ([`EngineCore::add_adapter`]) are registered by name over the engine's model;
//! a request names one (or none) and its rows carry it, so the rows of many adapters decode in
//! one batched forward ([`RowAdapters`]). A row samples exactly as it would with its adapter
//! attached to the model alone; removing an adapter affects only later requests.
//!
//! Priority lane: a request marked `priority` (the server marks a small request of a tenant
//! that has nothing else running beside another's saturated batch) is admitted into a second
//! batch with its own cache, and the two batches take turns by time: after a main step the lane
//! may decode for as long as that step took, then the main batch steps again (the lane alone
//! decodes while the main batch is empty, and the main batch while the lane is). So a small
//! request's tokens cost its own small steps, not the saturated batch's, and it waits for at
//! most the main step in flight when it came and, if its own steps take longer than a main
//! step, one more; the main batch keeps at least half of the engine's time. Each batch is
//! admitted under the scheduler on its own (the lane's requests are few and small by the
//! caller's choice).
//!
//! Simplifications: no paged attention and no prefix cache across steps (the dense padded cache
//! is what the model's forward takes); FIFO admission (a large request at the head waits for
//! room rather than being overtaken).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use candle_core::Device;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;

use super::prefill::{prefill_batch, PrefillItem, Prefilled, PromptScores};
use super::request::{Generation, Request, RequestOutput, StopReason};
use super::sampler::sample;
use super::scheduler::{Demand, Scheduler};
use super::top_logprobs::top_logprobs;
use crate::model::row_adapters::{Adapter, RowAdapters};
use crate::model::tape::Held;
use crate::model::tokenizer::Tokenizer;
use crate::model::weight_update::WeightUpdate;
use crate::model::{KvCache, Transformer};
use crate::{Error, Result};

pub type RequestId = u64;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Rows (samples) decoded together at most.
    pub max_batch: usize,
    /// KV-cache budget in token slots (row × position); None = max_batch × max_position_embeddings.
    pub kv_cache_tokens: Option<usize>,
    /// Ids that end a sample unless its params say `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Needed for stop strings.
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// Tensor-math threads of an [`super::Engine`]'s thread (its own rayon pool). Default 1:
    /// small-batch decoding is fastest on one thread (BENCHMARKS.md).
    pub threads: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { max_batch: 64, kv_cache_tokens: None, eos_token_ids: vec![], tokenizer: None, threads: 1 }
    }
}

crate::choice! {
    /// How a pause treats requests in flight (a run config's `async_rl.weight_update` too).
    pub enum PauseMode("weight update mode") {
        /// Running requests freeze and continue after `resume` where they were (a weight update in
        /// between recomputes their KV caches under the new weights).
        Keep = "keep",
        /// Running requests end now with what they have, stop reason `abort`.
        Abort = "abort",
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    pub version: u64,
    pub paused: bool,
    pub running_requests: usize,
    pub running_rows: usize,
    pub waiting_requests: usize,
    /// Columns of the running cache.
    pub cached_positions: usize,
    pub kv_cache_tokens: usize,
    pub kv_bytes_per_token: usize,
}

/// One sample being decoded.
struct Row {
    id: RequestId,
    sample: usize,
    /// Fed at the next step: the last prompt token, then each sampled token.
    next_token: u32,
    next_pos: u32,
    rng: StdRng,
    gen: Generation,
    adapter: Option<Arc<Adapter>>,
}

/// An admitted request: its samples as they finish.
struct Active {
    req: Request,
    stops: Vec<u32>,
    samples: Vec<Option<Generation>>,
    prompt: PromptScores,
    left: usize,
}

/// The priority lane's batch (see the module documentation).
struct Lane {
    rows: Vec<Row>,
    cache: KvCache,
    waiting: VecDeque<(RequestId, Request, Option<Arc<Adapter>>)>,
}

pub struct EngineCore {
    model: Transformer,
    config: EngineConfig,
    /// Admission under `max_batch` and the KV budget.
    scheduler: Scheduler,
    version: u64,
    paused: bool,
    cache: KvCache,
    rows: Vec<Row>,
    /// Queued requests with their adapter, resolved at `add_request`.
    waiting: VecDeque<(RequestId, Request, Option<Arc<Adapter>>)>,
    adapters: HashMap<String, Arc<Adapter>>,
    active: HashMap<RequestId, Active>,
    /// Outputs ready for the next `step` to return (aborts, max_tokens = 0).
    ready: Vec<(RequestId, RequestOutput)>,
    next_id: RequestId,
    /// The priority lane, swapped with the fields above while it is worked on.
    lane: Lane,
    /// Seconds the lane may still decode before the main batch's next step.
    lane_credit: f64,
}

impl EngineCore {
    pub fn new(model: Transformer, config: EngineConfig) -> Result<Self> {
        let budget = config.kv_cache_tokens.unwrap_or(config.max_batch * model.config.max_position_embeddings);
        let scheduler = Scheduler::new(config.max_batch, budget)?;
        // The engine's weights are its own (see `Transformer::without_variables`).
        let model = model.without_variables()?;
        let cache = model.new_cache();
        let lane = Lane { rows: vec![], cache: model.new_cache(), waiting: VecDeque::new() };
        Ok(EngineCore {
            model,
            config,
            scheduler,
            version: 0,
            paused: false,
            cache,
            rows: vec![],
            waiting: VecDeque::new(),
            adapters: HashMap::new(),
            active: HashMap::new(),
            ready: vec![],
            next_id: 0,
            lane,
            lane_credit: 0.0,
        })
    }

    pub fn model(&self) -> &Transformer {
        &self.model
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Bytes of K and V per cached token of one row (of the full-attention layers: a Qwen3.5
    /// DeltaNet layer keeps a state per row that does not grow with the tokens, a Gemma 3
    /// sliding layer at most about twice its window).
    pub fn kv_bytes_per_token(&self) -> usize {
        let c = &self.model.config;
        let layers = (0..c.num_hidden_layers).filter(|&i| !c.is_linear_attention(i) && !c.is_sliding(i)).count();
        2 * layers * c.num_key_value_heads * c.head_dim * self.model.dtype.size_in_bytes()
    }

    /// Registers LoRA adapter `name` (replacing one of that name) for later requests.
    pub fn add_adapter(&mut self, name: &str, adapter: Arc<Adapter>) {
        self.adapters.insert(name.to_string(), adapter);
    }

    /// Unregisters adapter `name`: requests already queued or running keep it. Whether it existed.
    pub fn remove_adapter(&mut self, name: &str) -> bool {
        self.adapters.remove(name).is_some()
    }

    /// Checks the request and queues it; it is admitted by a later `step`.
    pub fn add_request(&mut self, mut req: Request) -> Result<RequestId> {
        self.validate(&req)?;
        let adapter = match &req.adapter {
            None => None,
            Some(name) => Some(self.adapters.get(name).cloned().ok_or_else(|| {
                Error::input(format!("unknown LoRA adapter `{name}` (not registered on this engine)"))
            })?),
        };
        // Fix the seed now so that every sample's stream is known (and a continuation can
        // resume it).
        req.params.seed.get_or_insert_with(rand::random);
        let id = self.next_id;
        self.next_id += 1;
        if req.priority {
            self.lane.waiting.push_back((id, req, adapter));
        } else {
            self.waiting.push_back((id, req, adapter));
        }
        Ok(id)
    }

    fn validate(&self, req: &Request) -> Result<()> {
        let p = &req.params;
        p.validate()?;
        let c = &self.model.config;
        if req.num_samples == 0 {
            return Err(Error::input("num_samples must be positive"));
        }
        if req.prompt.is_empty() {
            return Err(Error::input("the prompt is empty"));
        }
        crate::model::check_token_ids(&req.prompt, c.vocab_size, "prompt")?;
        for &(token, bias) in &req.logit_bias {
            if token as usize >= c.vocab_size || !bias.is_finite() {
                return Err(Error::input(format!(
                    "logit bias {bias} of token {token}: the token must be below the vocabulary size {} and the bias finite",
                    c.vocab_size
                )));
            }
        }
        let limit = c.max_position_embeddings;
        let len = req.prompt.len();
        if len + p.max_tokens > limit {
            return Err(Error::input(format!(
                "prompt length {len} + max_tokens {} exceeds max_position_embeddings {limit}",
                p.max_tokens
            )));
        }
        self.scheduler.check_fits(req.num_samples, len, p.max_tokens, self.kv_bytes_per_token())?;
        if !p.stop_strings.is_empty() && self.config.tokenizer.is_none() {
            return Err(Error::input("stop strings need an engine with a tokenizer"));
        }
        Ok(())
    }

    /// Each sample of request `id` decoded so far (running or finished), with its sample
    /// index; empty once the request has completed (its output has everything).
    pub fn progress(&self, id: RequestId) -> Vec<(usize, &Generation)> {
        let Some(a) = self.active.get(&id) else { return vec![] };
        let finished = a.samples.iter().enumerate().filter_map(|(i, g)| g.as_ref().map(|g| (i, g)));
        let running = self.rows.iter().chain(&self.lane.rows).filter(|r| r.id == id).map(|r| (r.sample, &r.gen));
        finished.chain(running).collect()
    }

    /// Whether a `step` would do anything.
    pub fn has_work(&self) -> bool {
        !self.ready.is_empty() || (!self.paused && self.has_work_unpaused())
    }

    /// Whether requests are running or waiting (in either batch).
    fn has_work_unpaused(&self) -> bool {
        let lane = !self.lane.rows.is_empty() || !self.lane.waiting.is_empty();
        !self.rows.is_empty() || !self.waiting.is_empty() || lane
    }

    /// Runs `f` with the priority lane in place of the main batch (rows, cache, queue).
    fn in_lane<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        self.swap_lane();
        let r = f(self);
        self.swap_lane();
        r
    }

    fn swap_lane(&mut self) {
        std::mem::swap(&mut self.rows, &mut self.lane.rows);
        std::mem::swap(&mut self.cache, &mut self.lane.cache);
        std::mem::swap(&mut self.waiting, &mut self.lane.waiting);
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            version: self.version,
            paused: self.paused,
            running_requests: self.active.len(),
            running_rows: self.rows.len() + self.lane.rows.len(),
            waiting_requests: self.waiting.len() + self.lane.waiting.len(),
            cached_positions: self.cache.seq_len().max(self.lane.cache.seq_len()),
            kv_cache_tokens: self.scheduler.budget,
            kv_bytes_per_token: self.kv_bytes_per_token(),
        }
    }

    /// Stops intake and decoding. `Abort` ends every running request now (returned here, with
    /// stop reason `abort`); `Keep` freezes them. Waiting requests stay queued either way.
    pub fn pause(&mut self, mode: PauseMode) -> Vec<(RequestId, RequestOutput)> {
        self.paused = true;
        if mode == PauseMode::Abort {
            self.abort_running();
        }
        std::mem::take(&mut self.ready)
    }

    /// Ends every running request as `abort` (outputs to `ready`) and empties the batch.
    fn abort_running(&mut self) {
        let mut ids: Vec<RequestId> = self.active.keys().copied().collect();
        ids.sort();
        for id in ids {
            let out = self.abort_active(id);
            self.ready.push((id, out));
        }
        self.rows.clear();
        self.cache = self.model.new_cache();
        self.lane.rows.clear();
        self.lane.cache = self.model.new_cache();
    }

    /// Drops every request, running or waiting, without output (after a failed step, whose
    /// state cannot be trusted).
    pub fn reset(&mut self) {
        self.rows.clear();
        self.active.clear();
        self.waiting.clear();
        self.ready.clear();
        self.cache = self.model.new_cache();
        self.lane = Lane { rows: vec![], cache: self.model.new_cache(), waiting: VecDeque::new() };
    }

    pub fn resume(&mut self) {
        self.paused = false;
    }

    /// Swaps in new weights; tokens sampled from now on carry `version`. Running (or frozen)
    /// rows keep their place, tokens and random streams, and their KV caches are recomputed
    /// under the new weights (see the module documentation), so their next tokens have exactly
    /// the new weights' log-probs.
    ///
    /// A refused update (see [`WeightUpdate::apply`]) changes nothing. If the caches cannot be
    /// recomputed (e.g. out of memory) the new weights stay in place, the running requests end
    /// as `abort` with the tokens they have (returned by the next `step` or `pause`, and
    /// continued by the engine client), and the error says so.
    pub fn update_weights(&mut self, update: &WeightUpdate, version: u64) -> Result<()> {
        self.model = update.apply(&self.model)?;
        self.version = version;
        let rows = self.rows.len() + self.lane.rows.len();
        if rows == 0 {
            return Ok(());
        }
        let recompute = |e: &mut Self| -> Result<()> {
            if !e.rows.is_empty() {
                // The old cache goes first: the rebuilt one takes its place in the KV budget.
                e.cache = e.model.new_cache();
                e.cache = e.recompute_cache()?;
            }
            Ok(())
        };
        match recompute(self).and_then(|()| self.in_lane(recompute)) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.abort_running();
                Err(Error::Other(format!(
                    "weights updated to version {version}, but the KV caches of the {rows} running rows could not be \
                     recomputed ({e}): their requests were aborted"
                )))
            }
        }
    }

    /// The running rows' cache under the current weights, in row order: each row's prompt +
    /// tokens so far prefilled as at admission (all but the pending token, which the next decode
    /// step feeds), identical prefixes once, rows of one length in one forward.
    fn recompute_cache(&self) -> Result<KvCache> {
        let mut seqs = Vec::with_capacity(self.rows.len());
        for row in &self.rows {
            let req = &self.active[&row.id].req;
            let seq: Vec<u32> = req.prompt.iter().chain(&row.gen.tokens).copied().collect();
            if seq.last() != Some(&row.next_token) || row.next_pos as usize + 1 != seq.len() {
                return Err(Error::Other(format!(
                    "row {} of request {} is inconsistent: {} tokens, pending token at position {}",
                    row.sample,
                    row.id,
                    seq.len(),
                    row.next_pos
                )));
            }
            seqs.push(seq);
        }
        let items: Vec<PrefillItem> = self
            .rows
            .iter()
            .zip(&seqs)
            .map(|(row, seq)| {
                let name = self.active[&row.id].req.adapter.as_deref();
                let adapter = name.zip(row.adapter.as_ref());
                PrefillItem { prompt: seq, adapter, logprobs: false, topk: 0 }
            })
            .collect();
        let prefilled = prefill_batch(&self.model, &items)?;
        let mut cache = self.model.new_cache();
        for (row, seq) in self.rows.iter().zip(seqs) {
            let key = (self.active[&row.id].req.adapter.clone(), seq);
            cache.append_rows(&prefilled[&key].0)?;
        }
        Ok(cache)
    }

    /// Ends one request now (waiting or running) with what it has; None if unknown.
    pub fn abort(&mut self, id: RequestId) -> Result<Option<RequestOutput>> {
        let queued = |q: &mut VecDeque<(RequestId, Request, Option<Arc<Adapter>>)>| {
            let i = q.iter().position(|(w, ..)| *w == id)?;
            q.remove(i)
        };
        if let Some((_, req, _)) = queued(&mut self.waiting).or_else(|| queued(&mut self.lane.waiting)) {
            let g = Generation { stop_reason: StopReason::Abort, ..Generation::empty() };
            let samples = vec![g; req.num_samples];
            return Ok(Some(RequestOutput { samples, prompt_logprobs: None, prompt_topk: None }));
        }
        if !self.active.contains_key(&id) {
            return Ok(None);
        }
        let out = self.abort_active(id);
        let in_lane = self.lane.rows.iter().any(|r| r.id == id);
        if in_lane {
            self.swap_lane();
        }
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&i| self.rows[i].id != id).collect();
        let kept = self.cache.select_rows(&keep).map(|cache| self.cache = cache);
        self.rows.retain(|r| r.id != id);
        if in_lane {
            self.swap_lane();
        }
        kept?;
        Ok(Some(out))
    }

    /// The output of `id` with its running rows ended as `abort` (the caller removes the rows
    /// and fixes up the cache).
    fn abort_active(&mut self, id: RequestId) -> RequestOutput {
        let mut a = self.active.remove(&id).expect("request is active");
        for r in self.rows.iter_mut().chain(self.lane.rows.iter_mut()).filter(|r| r.id == id) {
            let mut g = std::mem::replace(&mut r.gen, Generation::empty());
            g.stop_reason = StopReason::Abort;
            a.samples[r.sample] = Some(g);
        }
        let samples = a
            .samples
            .into_iter()
            .map(|s| s.unwrap_or_else(|| Generation { stop_reason: StopReason::Abort, ..Generation::empty() }));
        RequestOutput {
            samples: samples.collect(),
            prompt_logprobs: a.prompt.logprobs,
            prompt_topk: a.prompt.topk.map(|t| t.1),
        }
    }

    /// One engine step: admit, decode one token for every running row, retire finished rows.
    /// Returns the requests that completed.
    pub fn step(&mut self) -> Result<Vec<(RequestId, RequestOutput)>> {
        if self.paused {
            return Ok(std::mem::take(&mut self.ready));
        }
        self.admit()?;
        self.in_lane(|e| e.admit())?;
        // The lane decodes while it has credit (or alone); a main step renews the credit.
        if !self.lane.rows.is_empty() && (self.rows.is_empty() || self.lane_credit > 0.0) {
            let start = std::time::Instant::now();
            self.in_lane(|e| e.decode())?;
            self.lane_credit -= start.elapsed().as_secs_f64();
        } else if !self.rows.is_empty() {
            let start = std::time::Instant::now();
            self.decode()?;
            self.lane_credit = start.elapsed().as_secs_f64();
        }
        Ok(std::mem::take(&mut self.ready))
    }

    /// Runs steps until nothing is running or waiting; the outputs in request-id order.
    pub fn run_until_idle(&mut self) -> Result<Vec<(RequestId, RequestOutput)>> {
        if self.paused && self.has_work_unpaused() {
            return Err(Error::input("the engine is paused"));
        }
        let mut out = vec![];
        while self.has_work() {
            out.extend(self.step()?);
        }
        out.sort_by_key(|(id, _)| *id);
        Ok(out)
    }

    fn admit(&mut self) -> Result<()> {
        // The requests that fit leave the queue together and their prompts are prefilled in one
        // batch (one forward per prompt length; identical adapter + prompt pairs once).
        let longest = self.rows.iter().map(|r| self.active[&r.id].final_len()).max().unwrap_or(0);
        let admitted: Vec<_> = self.waiting.drain(..self.admissible(longest)).collect();
        if admitted.is_empty() {
            return Ok(());
        }
        let items: Vec<PrefillItem> = admitted.iter().map(|(_, req, a)| PrefillItem::of(req, a.as_ref())).collect();
        let prefilled: Prefilled = prefill_batch(&self.model, &items)?;
        // The new rows' caches (each prompt's once per sample), joined to the batch at once.
        let mut new_rows: Vec<&KvCache> = vec![&self.cache];
        for (id, req, adapter) in admitted {
            let n = req.num_samples;
            let (one, scores) = &prefilled[&(req.adapter.clone(), req.prompt.clone())];
            let mut stops = req.params.stop_token_ids.clone();
            if !req.params.ignore_eos {
                stops.extend_from_slice(&self.config.eos_token_ids);
            }
            let mut active = Active { samples: vec![None; n], prompt: scores.for_request(&req), left: n, stops, req };
            if active.req.params.max_tokens == 0 {
                active.samples = vec![Some(Generation::empty()); n];
                self.ready.push((id, active.into_output()));
                continue;
            }
            new_rows.extend(std::iter::repeat_n(one, n));
            let p = &active.req.params;
            let base = p.seed.expect("seed fixed at add_request");
            for sample in 0..n {
                let mut rng = StdRng::seed_from_u64(base.wrapping_add(sample as u64));
                if p.temperature > 0.0 {
                    // The sampler draws one number per non-greedy token.
                    for _ in 0..active.req.rng_skip {
                        rng.random::<f64>();
                    }
                }
                let last = active.req.prompt.len() - 1;
                self.rows.push(Row {
                    id,
                    sample,
                    next_token: active.req.prompt[last],
                    next_pos: last as u32,
                    rng,
                    gen: Generation::empty(),
                    adapter: adapter.clone(),
                });
            }
            self.active.insert(id, active);
        }
        let cache = KvCache::concat_rows(&new_rows)?;
        self.cache = cache;
        Ok(())
    }

    /// How many requests from the front of the queue fit ([`Scheduler::admissible`]).
    fn admissible(&self, longest: usize) -> usize {
        let demand = |req: &Request| Demand {
            rows: req.num_samples,
            final_len: req.prompt.len() + req.params.max_tokens,
            decodes: req.params.max_tokens > 0,
        };
        self.scheduler.admissible(self.rows.len(), longest, self.waiting.iter().map(|(_, req, _)| demand(req)))
    }

    fn decode(&mut self) -> Result<()> {
        let ids: Vec<Vec<u32>> = self.rows.iter().map(|r| vec![r.next_token]).collect();
        let pos: Vec<Vec<u32>> = self.rows.iter().map(|r| vec![r.next_pos]).collect();
        let mask = vec![vec![1u8]; self.rows.len()];
        let adapters: Vec<Option<&Arc<Adapter>>> = self.rows.iter().map(|r| r.adapter.as_ref()).collect();
        let adapters = RowAdapters::new(&adapters, &self.model.device)?;
        let hidden = self.model.forward_hidden_adapted(&ids, &pos, &mask, Some(&mut self.cache), adapters.as_ref())?;
        let logits = self.model.logits_adapted(&hidden, adapters.as_ref())?.squeeze(1)?;
        let draws = match self.draw_on_device(&logits)? {
            Some(draws) => draws,
            None => self.draw_on_host(&logits)?,
        };
        let mut finished = vec![];
        for (i, (row, draw)) in self.rows.iter_mut().zip(draws).enumerate() {
            let a = &self.active[&row.id];
            let p = &a.req.params;
            let (tok, lp, topk) = draw?;
            row.gen.tokens.push(tok);
            row.gen.logprobs.push(lp);
            row.gen.versions.push(self.version);
            if let Some(topk) = topk {
                row.gen.topk.push(topk);
            }
            row.next_token = tok;
            row.next_pos += 1;
            let stop = a.stops.contains(&tok)
                || stop_string_hit(self.config.tokenizer.as_deref(), &p.stop_strings, &row.gen.tokens)?;
            if stop || row.gen.tokens.len() >= p.max_tokens {
                row.gen.stop_reason = if stop { StopReason::Stop } else { StopReason::Length };
                finished.push(i);
            }
        }
        if finished.is_empty() {
            return Ok(());
        }
        let keep: Vec<usize> = (0..self.rows.len()).filter(|i| !finished.contains(i)).collect();
        self.cache = self.cache.select_rows(&keep)?;
        let mut rows = std::mem::take(&mut self.rows).into_iter().map(Some).collect::<Vec<_>>();
        for &i in &finished {
            let row = rows[i].take().expect("finished once");
            let a = self.active.get_mut(&row.id).expect("row's request is active");
            a.samples[row.sample] = Some(row.gen);
            a.left -= 1;
            if a.left == 0 {
                let a = self.active.remove(&row.id).expect("present");
                self.ready.push((row.id, a.into_output()));
            }
        }
        self.rows = rows.into_iter().flatten().collect();
        Ok(())
    }
}

impl Active {
    fn final_len(&self) -> usize {
        self.req.prompt.len() + self.req.params.max_tokens
    }

    fn into_output(self) -> RequestOutput {
        RequestOutput {
            samples: self.samples.into_iter().map(|s| s.expect("every sample finished")).collect(),
            prompt_logprobs: self.prompt.logprobs,
            prompt_topk: self.prompt.topk.map(|t| t.1),
        }
    }
}

/// One row's draw: the token, its log-prob, and the top-k log-probs when the request asked.
type Draw = (u32, f32, Option<Vec<(u32, f32)>>);

impl EngineCore {
    /// Each row's draw (and top-k log-probs) from its own logits and random stream, on the CPU,
    /// the rows over the pool: independent, so the same at any thread count.
    fn draw_on_host(&mut self, logits: &candle_core::Tensor) -> Result<Vec<Result<Draw>>> {
        // The rows read in place (a copy of B × V logits per step cost a measurable share).
        let logits = logits.to_device(&Device::Cpu)?;
        let held = Held::<f32>::new(&logits)?;
        let vocab = logits.dim(1)?;
        let active = &self.active;
        Ok(self
            .rows
            .par_iter_mut()
            .zip(held.slice()?.par_chunks_exact(vocab))
            .with_min_len(4)
            .map(|(row, z)| {
                let a = &active[&row.id];
                let p = &a.req.params;
                let biased;
                let z = match a.req.logit_bias.is_empty() {
                    true => z,
                    false => {
                        biased = with_bias(z, &a.req.logit_bias);
                        &biased[..]
                    }
                };
                let (tok, lp) = sample(z, p, &mut row.rng)?;
                let t = if p.temperature > 0.0 { p.temperature } else { 1.0 };
                let topk = (a.req.sample_topk > 0).then(|| top_logprobs(z, a.req.sample_topk, t));
                Ok((tok, lp, topk))
            })
            .collect())
    }

    /// On a GPU with oxrl's kernels on, every row's draw on the device (`ops::sample_rows`) when
    /// no row needs the host
    /// (top-k / top-p truncation, top log-probs): B tokens and log-probs cross to the host
    /// instead of B × V logits, and the host's sampling over the vocabulary is gone. Each
    /// sampled row takes one number from its random stream, as the host's draw does.
    #[cfg(feature = "cuda")]
    fn draw_on_device(&mut self, logits: &candle_core::Tensor) -> Result<Option<Vec<Result<Draw>>>> {
        use super::sampler::is_greedy;
        if !logits.device().is_cuda() || !crate::model::ops::cuda_kernels() {
            return Ok(None);
        }
        let vocab = logits.dim(1)?;
        let active = &self.active;
        let on_host = |r: &Row| {
            let a = &active[&r.id];
            let p = &a.req.params;
            a.req.sample_topk > 0 || !a.req.logit_bias.is_empty() || p.top_p < 1.0 || (p.top_k > 0 && p.top_k < vocab)
        };
        if self.rows.iter().any(on_host) {
            return Ok(None);
        }
        let (mut inv_t, mut u) = (Vec::with_capacity(self.rows.len()), Vec::with_capacity(self.rows.len()));
        for row in &mut self.rows {
            let t = active[&row.id].req.params.temperature;
            if is_greedy(t) {
                inv_t.push(0.0);
                u.push(0.0);
            } else {
                inv_t.push((1.0 / t) as f32);
                u.push(row.rng.random::<f64>());
            }
        }
        let drawn = crate::model::ops::sample_rows::sample_rows(logits, &inv_t, &u)?;
        Ok(Some(drawn.into_iter().map(|(tok, lp)| Ok((tok, lp, None))).collect()))
    }

    #[cfg(not(feature = "cuda"))]
    fn draw_on_device(&mut self, _: &candle_core::Tensor) -> Result<Option<Vec<Result<Draw>>>> {
        Ok(None)
    }
}

/// A row of logits with the request's biases added.
fn with_bias(z: &[f32], bias: &[(u32, f32)]) -> Vec<f32> {
    let mut out = z.to_vec();
    for &(token, b) in bias {
        out[token as usize] += b;
    }
    out
}

/// Whether the decoded completion contains a stop string.
fn stop_string_hit(tok: Option<&Tokenizer>, stops: &[String], tokens: &[u32]) -> Result<bool> {
    if stops.is_empty() {
        return Ok(false);
    }
    let tok = tok.ok_or_else(|| Error::input("stop strings need an engine with a tokenizer"))?;
    // The whole completion is decoded: a token's text can depend on its neighbours (byte-level
    // pieces of one character), so decoding only the new token would miss some matches.
    let text = tok.decode(tokens, false)?;
    Ok(stops.iter().any(|s| text.contains(s.as_str())))
}
