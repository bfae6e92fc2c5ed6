//! Training clients: one LoRA adapter per SDK training client, all over the served base models,
//! created through [`Dispatch::create_model`] (LoRA models over one base share its weights).
//!
//! Ordering: the SDK numbers each training client's requests with `seq_id` 1, 2, 3, … and may
//! send them out of order and concurrently. Each model keeps a queue: a request waits until every
//! smaller seq_id has been submitted, then is submitted to the dispatch, whose calls on one model
//! run in submission order; so requests run strictly in seq_id order. A repeated
//! `(model_id, seq_id)` (the SDK resends on retry) returns the original request id. A model's
//! queue stays closed until the model is built, so requests may arrive while it loads.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::errors::{ApiError, ApiResult};
use super::types::LoraConfigWire;
use crate::dispatch::{Dispatch, WorkerSpec};
use crate::locks::lock;
use crate::model::lora::LoraConfig;
use crate::worker::WorkerConfig;

/// A base model the server serves.
#[derive(Clone, Debug)]
pub struct ServedModel {
    /// The directory's name (a Hub snapshot's: the repo id), as clients name it.
    pub name: String,
    pub path: PathBuf,
    pub arch: Option<String>,
    pub max_context_length: Option<u64>,
    /// What a token of a forward_backward keeps in memory until its backward is done (f32
    /// activations): 4 bytes × (layers × (8·hidden + 3·intermediate) + 2·vocab) — the inputs of
    /// every projection, the norms and residuals, the MLP's three intermediate rows, the logits and
    /// their gradient. An estimate for admission, not a measurement.
    pub bytes_per_token: usize,
}

impl ServedModel {
    pub fn from_dir(path: &std::path::Path) -> crate::Result<ServedModel> {
        let config_path = path.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| crate::Error::file(&config_path, e))?;
        let config: Value = serde_json::from_str(&text).map_err(|e| crate::Error::file(&config_path, e))?;
        let name = path
            .canonicalize()
            .ok()
            .and_then(|p| crate::model::hub::served_name(&p))
            .unwrap_or_else(|| path.display().to_string());
        Ok(ServedModel {
            name,
            path: path.to_path_buf(),
            arch: config.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).map(String::from),
            max_context_length: config.get("max_position_embeddings").and_then(Value::as_u64),
            bytes_per_token: {
                let n = |k: &str| config.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
                let (hidden, intermediate) = (n("hidden_size"), n("intermediate_size"));
                4 * (n("num_hidden_layers") * (8 * hidden + 3 * intermediate) + 2 * n("vocab_size")).max(1)
            },
        })
    }

    pub fn matches(&self, name: &str) -> bool {
        name == self.name || std::path::Path::new(name) == self.path
    }
}

/// LoRA alpha for Tinker's adapters: the scale is alpha / rank.
pub const LORA_ALPHA: f64 = 32.0;

/// Tinker's LoRA switches as the worker's target modules.
pub fn lora_config(wire: &LoraConfigWire) -> ApiResult<LoraConfig> {
    if wire.rank == 0 {
        return Err(ApiError::user("lora_config.rank must be at least 1"));
    }
    let mut targets = vec![];
    if wire.train_attn {
        targets.extend(["q_proj", "k_proj", "v_proj", "o_proj"]);
    }
    if wire.train_mlp {
        targets.extend(["gate_proj", "up_proj", "down_proj"]);
    }
    if wire.train_unembed {
        targets.push("lm_head");
    }
    if targets.is_empty() {
        return Err(ApiError::user(
            "lora_config: train_attn, train_mlp and train_unembed are all false: nothing to train",
        ));
    }
    Ok(LoraConfig::new(wire.rank, LORA_ALPHA, &targets))
}

/// A checkpoint saved with LoRA settings `saved` can be loaded into model `model_id` of
/// settings `model` only when the trained parts agree (rank and which layers; the seed only
/// initialised the saved weights): otherwise a user error naming both and what to change.
pub fn check_loadable(
    checkpoint: &str,
    saved: &LoraConfigWire,
    model_id: &str,
    model: &LoraConfigWire,
) -> ApiResult<()> {
    let parts = |c: &LoraConfigWire| {
        let on = [(c.train_attn, "attention"), (c.train_mlp, "MLP"), (c.train_unembed, "unembedding")];
        on.iter().filter(|(t, _)| *t).map(|(_, n)| *n).collect::<Vec<_>>().join(" + ")
    };
    if saved.rank != model.rank {
        return Err(ApiError::user(format!(
            "checkpoint `{checkpoint}` was saved at LoRA rank {}, but model `{model_id}` has rank {}: load it into a \
             training client created with rank {} (or create one from the checkpoint: create_training_client_from_state)",
            saved.rank, model.rank, saved.rank
        )));
    }
    let (a, b) = (parts(saved), parts(model));
    if a != b {
        return Err(ApiError::user(format!(
            "checkpoint `{checkpoint}` trains LoRA on {a}, but model `{model_id}` on {b}: load it into a training \
             client created with the same train_attn / train_mlp / train_unembed (or create one from the checkpoint: \
             create_training_client_from_state)"
        )));
    }
    Ok(())
}

/// Runs on a freshly built model before its queue opens (e.g. loading a checkpoint).
pub type AfterBuild = Box<dyn FnOnce(&Dispatch, &str) -> crate::Result<()> + Send>;

/// A job waiting for its turn: it submits its call(s) to the dispatch (non-blocking).
pub type Job = Box<dyn FnOnce(&Arc<Dispatch>) + Send>;

#[derive(Default)]
struct Queue {
    /// Submission is held until the model is built.
    open: bool,
    /// The next seq_id to submit.
    next: i64,
    waiting: BTreeMap<i64, Job>,
    /// seq_id → request id, for repeated requests.
    seen: HashMap<i64, String>,
}

pub struct TrainingModel {
    pub id: String,
    pub session_id: String,
    pub base: ServedModel,
    /// The base model as the client named it (a served name or the path given to `--model`):
    /// `get_info` echoes it as the model name and tokenizer id, never the server's own path.
    pub named: String,
    pub lora: LoraConfigWire,
    queue: Mutex<Queue>,
    /// Tokens of this model's forward / forward_backward requests accepted and not yet done.
    in_flight: Arc<AtomicUsize>,
}

/// Tokens admitted for one request: given back when it is dropped (the request done or failed).
pub struct Admitted {
    in_flight: Arc<AtomicUsize>,
    tokens: usize,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(self.tokens, Ordering::SeqCst);
    }
}

impl TrainingModel {
    /// Admits a request of `tokens` if the model's tokens in flight stay within `budget`.
    pub fn admit(&self, tokens: usize, budget: usize) -> ApiResult<Admitted> {
        let mut now = self.in_flight.load(Ordering::SeqCst);
        loop {
            if now + tokens > budget {
                return Err(ApiError::user(format!(
                    "model `{}` has {now} tokens in flight; {tokens} more would pass its memory budget of {budget} \
                     tokens (oxrl serve --max-tokens-in-flight): wait for its requests to finish",
                    self.id
                )));
            }
            match self.in_flight.compare_exchange(now, now + tokens, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Ok(Admitted { in_flight: self.in_flight.clone(), tokens }),
                Err(actual) => now = actual,
            }
        }
    }
}

pub struct Models {
    pub dispatch: Arc<Dispatch>,
    models: Mutex<HashMap<String, Arc<TrainingModel>>>,
    /// Tensor-math threads per model.
    threads: usize,
}

impl Models {
    pub fn new(threads: usize) -> Self {
        Models { dispatch: Arc::new(Dispatch::new(false)), models: Mutex::new(HashMap::new()), threads }
    }

    pub fn get(&self, id: &str) -> ApiResult<Arc<TrainingModel>> {
        lock(&self.models).get(id).cloned().ok_or_else(|| ApiError::not_found(format!("no training model `{id}`")))
    }

    /// Registers model `id` (its queue closed) and returns a closure that builds it (blocking:
    /// run it off the async threads), then opens the queue.
    pub fn register(
        self: &Arc<Self>,
        id: &str,
        session_id: &str,
        (base, named): (ServedModel, &str),
        lora: LoraConfigWire,
        after_build: Option<AfterBuild>,
    ) -> ApiResult<impl FnOnce() -> ApiResult<Value> + Send + 'static> {
        let config = lora_config(&lora)?;
        let model = Arc::new(TrainingModel {
            id: id.to_string(),
            session_id: session_id.to_string(),
            base: base.clone(),
            named: named.to_string(),
            lora: lora.clone(),
            queue: Mutex::new(Queue { open: false, next: 1, ..Default::default() }),
            in_flight: Arc::default(),
        });
        {
            let mut models = lock(&self.models);
            if models.contains_key(id) {
                return Err(ApiError::user(format!("model `{id}` already exists")));
            }
            models.insert(id.to_string(), model.clone());
        }
        let spec = WorkerSpec {
            threads: self.threads,
            worker: WorkerConfig { lora: Some(config), seed: lora.seed.unwrap_or(0), ..Default::default() },
            ..WorkerSpec::new(base.path.clone())
        };
        let me = self.clone();
        let id = id.to_string();
        Ok(move || {
            let mut built = me.dispatch.create_model(&id, &spec);
            if let (Ok(()), Some(after)) = (&built, after_build) {
                built = after(&me.dispatch, &id);
                if built.is_err() {
                    let _ = me.dispatch.drop_model(&id);
                }
            }
            if built.is_err() {
                lock(&me.models).remove(&id);
            }
            // Open the queue either way: queued calls then fail with the dispatch's error.
            me.open(&model);
            built.map_err(ApiError::from)?;
            Ok(json!({"model_id": id, "type": "create_model"}))
        })
    }

    /// The session of every model alive (one entry per model).
    pub fn sessions(&self) -> Vec<String> {
        lock(&self.models).values().map(|m| m.session_id.clone()).collect()
    }

    /// Drops every model of session `session_id` (they answer 404 afterwards).
    pub fn drop_session(&self, session_id: &str) {
        let dropped: Vec<String> = {
            let mut models = lock(&self.models);
            let ids: Vec<String> =
                models.values().filter(|m| m.session_id == session_id).map(|m| m.id.clone()).collect();
            for id in &ids {
                models.remove(id);
            }
            ids
        };
        for id in dropped {
            let _ = self.dispatch.drop_model(&id);
        }
    }

    fn open(&self, model: &TrainingModel) {
        let mut q = lock(&model.queue);
        q.open = true;
        self.pump(&mut q);
    }

    /// Queues a call of `model` with `seq_id`: `make` creates its future (returning the request
    /// id) and the job; a repeated seq_id returns the first request id and queues nothing.
    pub fn submit(
        &self,
        model: &TrainingModel,
        seq_id: i64,
        make: impl FnOnce() -> ApiResult<(String, Job)>,
    ) -> ApiResult<String> {
        let mut q = lock(&model.queue);
        if let Some(id) = q.seen.get(&seq_id) {
            return Ok(id.clone());
        }
        if seq_id < 1 {
            return Err(ApiError::user(format!("seq_id must be at least 1, got {seq_id}")));
        }
        if seq_id < q.next {
            return Err(ApiError::user(format!(
                "seq_id {seq_id} of model `{}` was already used (next is {})",
                model.id, q.next
            )));
        }
        let (request_id, job) = make()?;
        q.seen.insert(seq_id, request_id.clone());
        q.waiting.insert(seq_id, job);
        self.pump(&mut q);
        Ok(request_id)
    }

    fn pump(&self, q: &mut Queue) {
        if !q.open {
            return;
        }
        while let Some(job) = {
            let next = q.next;
            q.waiting.remove(&next)
        } {
            q.next += 1;
            job(&self.dispatch);
        }
    }
}
