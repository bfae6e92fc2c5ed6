//! Sampling sessions: a sampler is the served base model with, optionally, a LoRA adapter from a
//! checkpoint directory (PEFT layout).
//!
//! Every sampler of a base runs on that base's one continuous-batching [`Engine`]: a sampler's
//! adapter is registered on the engine under the sampler id and its requests name it, so the
//! requests of many LoRA clients decode together in one batch (per-row adapters, see
//! [`crate::model::row_adapters`]), each exactly as it would alone. The engine decodes up to
//! twice `--max-samples` rows; its requests pass its [`FairShare`] first (one key at most
//! `--max-samples` rows at once, waiting requests let through round-robin across keys and
//! sessions, a small request beside another key's rows in the engine's priority lane of an eighth
//! of that).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::errors::{ApiError, ApiResult};
use super::fair_share::FairShare;
use super::models::ServedModel;
use crate::handle::Handle;
use crate::locks::lock;
use crate::model::row_adapters::Adapter;
use crate::model::tokenizer::Tokenizer;
use crate::model::Transformer;
use crate::rollout::{Engine, EngineConfig, Request, RequestOutput};

pub struct Sampler {
    pub id: String,
    pub base: ServedModel,
    /// The `tinker://` path it samples from (None: the bare base model).
    pub model_path: Option<String>,
    /// Whether its adapter is registered on the engine (under `id`).
    has_adapter: bool,
    engine: Arc<Engine>,
    /// The engine's turns between tenants.
    pub share: Arc<FairShare>,
}

impl Drop for Sampler {
    fn drop(&mut self) {
        if self.has_adapter {
            // Requests already submitted keep the adapter; later ones cannot name it.
            drop(self.engine.remove_adapter(&self.id));
        }
    }
}

/// A base's engine and its turns between tenants.
type EngineAndTurns = (Arc<Engine>, Arc<FairShare>);

pub struct Samplers {
    /// Rows one key may have decoding at once (`--max-samples`); an engine decodes twice that.
    per_key_rows: usize,
    /// One engine per served base (by name), loaded at its first sampler, with its turns.
    engines: Mutex<HashMap<String, EngineAndTurns>>,
    samplers: Mutex<HashMap<String, Arc<Sampler>>>,
    /// Ephemeral samplers (from `save_weights_and_get_sampling_client`), oldest first, with the
    /// directory of their adapter.
    /// Ephemeral samplers in creation order: (owner's API key, id, directory).
    ephemeral: Mutex<VecDeque<(Option<String>, String, PathBuf)>>,
}

/// Ephemeral samplers kept at most per API key (an RL loop makes one per iteration); the key's
/// oldest is dropped (its adapter unregistered, its files removed) and later requests to it are
/// unknown ids. Per key, so that one tenant's loop never evicts another's samplers.
pub const MAX_EPHEMERAL: usize = 32;

impl Samplers {
    /// Samplers whose engines let one key decode `per_key_rows` rows at once.
    pub fn new(per_key_rows: usize) -> Self {
        Samplers {
            per_key_rows: per_key_rows.max(1),
            engines: Mutex::default(),
            samplers: Mutex::default(),
            ephemeral: Mutex::default(),
        }
    }

    pub fn get(&self, id: &str) -> ApiResult<Arc<Sampler>> {
        lock(&self.samplers).get(id).cloned().ok_or_else(|| ApiError::not_found(format!("no sampling session `{id}`")))
    }

    /// The engine of `base`, started (model loaded) at the first call.
    fn engine(&self, base: &ServedModel) -> crate::Result<EngineAndTurns> {
        let mut engines = lock(&self.engines);
        if let Some(e) = engines.get(&base.name) {
            return Ok(e.clone());
        }
        let model = Transformer::load(&base.path, candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let tokenizer = Tokenizer::from_dir(&base.path).ok().map(Arc::new);
        let eos_token_ids = match &tokenizer {
            Some(t) => t.eos_token_ids().to_vec(),
            None => model.config.eos_token_ids.clone(),
        };
        let max_batch = 2 * self.per_key_rows;
        let config = EngineConfig { eos_token_ids, tokenizer, threads: 1, max_batch, ..Default::default() };
        let engine = Arc::new(Engine::start(model, config)?);
        let share = FairShare::new(max_batch, self.per_key_rows, lane_rows(self.per_key_rows));
        engines.insert(base.name.clone(), (engine.clone(), share.clone()));
        Ok((engine, share))
    }

    /// Creates sampler `id` over `base` with the adapter in `adapter_dir` (blocking: loads
    /// weights, and the base's engine at its first sampler). An existing id is returned as is.
    pub fn create(
        &self,
        id: &str,
        base: &ServedModel,
        adapter_dir: Option<&Path>,
        model_path: Option<String>,
    ) -> crate::Result<Arc<Sampler>> {
        if let Some(s) = lock(&self.samplers).get(id) {
            return Ok(s.clone());
        }
        let (engine, share) = self.engine(base)?;
        if let Some(dir) = adapter_dir {
            // Read here (not on the engine thread, which keeps decoding), with shapes checked
            // against the engine's base (a cheap clone: tensors are shared).
            let model = engine.inspect(|m| m.clone()).wait()?;
            engine.add_adapter(id, Arc::new(Adapter::load_peft(&model, dir)?)).wait()?;
        }
        let has_adapter = adapter_dir.is_some();
        let sampler =
            Arc::new(Sampler { id: id.to_string(), base: base.clone(), model_path, has_adapter, engine, share });
        lock(&self.samplers).insert(id.to_string(), sampler.clone());
        Ok(sampler)
    }
}

impl Samplers {
    /// [`Samplers::create`] for an ephemeral sampler over the adapter in `dir` (blocking), then
    /// drops `owner`'s oldest ephemeral samplers beyond [`MAX_EPHEMERAL`].
    pub fn create_ephemeral(
        &self,
        owner: Option<&str>,
        id: &str,
        base: &ServedModel,
        dir: &Path,
    ) -> crate::Result<Arc<Sampler>> {
        let sampler = self.create(id, base, Some(dir), None)?;
        let evicted: Vec<(String, PathBuf)> = {
            let mut q = lock(&self.ephemeral);
            q.push_back((owner.map(String::from), id.to_string(), dir.to_path_buf()));
            let mine = q.iter().filter(|(o, _, _)| o.as_deref() == owner).count();
            let mut over = mine.saturating_sub(MAX_EPHEMERAL);
            let mut evicted = vec![];
            q.retain(|(o, old, old_dir)| {
                let evict = over > 0 && o.as_deref() == owner;
                if evict {
                    over -= 1;
                    evicted.push((old.clone(), old_dir.clone()));
                }
                !evict
            });
            evicted
        };
        for (old, old_dir) in evicted {
            let dropped = lock(&self.samplers).remove(&old);
            drop(dropped); // unregisters its adapter
            let _ = std::fs::remove_dir_all(old_dir);
        }
        Ok(sampler)
    }
}

impl Samplers {
    /// Checkpoint `uri` was written anew (`Some(dir)`: its adapter is reloaded from `dir` into
    /// every sampler made from it, blocking) or deleted (`None`: those samplers are dropped, and
    /// later requests to them are unknown ids). Without this a sampler would go on serving the
    /// old weights under the checkpoint's name.
    pub fn checkpoint_changed(&self, uri: &str, dir: Option<&Path>) -> crate::Result<()> {
        let from_it: Vec<Arc<Sampler>> =
            lock(&self.samplers).values().filter(|s| s.model_path.as_deref() == Some(uri)).cloned().collect();
        for s in from_it {
            match dir {
                Some(dir) if s.has_adapter => {
                    let model = s.engine.inspect(|m| m.clone()).wait()?;
                    s.engine.add_adapter(&s.id, Arc::new(Adapter::load_peft(&model, dir)?)).wait()?;
                }
                Some(_) => {}
                None => drop(lock(&self.samplers).remove(&s.id)),
            }
        }
        Ok(())
    }

    /// The session of every session sampler alive (`{session}:sample:{n}`), one entry each.
    pub fn sessions(&self) -> Vec<String> {
        let samplers = lock(&self.samplers);
        samplers
            .keys()
            .filter(|k| k.contains(":sample:"))
            .filter_map(|k| k.split(':').next())
            .map(String::from)
            .collect()
    }

    /// The ids of session `session_id`'s sampling sessions, sorted.
    pub fn session_ids(&self, session_id: &str) -> Vec<String> {
        let prefix = format!("{session_id}:sample:");
        let mut ids: Vec<String> = lock(&self.samplers).keys().filter(|k| k.starts_with(&prefix)).cloned().collect();
        ids.sort();
        ids
    }

    /// Drops the sampling sessions of session `session_id` (`{session_id}:sample:{n}`).
    pub fn drop_session(&self, session_id: &str) {
        let prefix = format!("{session_id}:sample:");
        let dropped: Vec<Arc<Sampler>> = {
            let mut samplers = lock(&self.samplers);
            let ids: Vec<String> = samplers.keys().filter(|k| k.starts_with(&prefix)).cloned().collect();
            ids.iter().filter_map(|id| samplers.remove(id)).collect()
        };
        lock(&self.ephemeral).retain(|(_, id, _)| !id.starts_with(&prefix));
        drop(dropped);
    }
}

/// Rows of an engine's priority lane (see [`FairShare`]): an eighth of a key's share, so that
/// the lane's steps stay small beside a saturated main batch.
fn lane_rows(per_key_rows: usize) -> usize {
    (per_key_rows / 8).max(1)
}

impl Sampler {
    /// Submits `req` to the engine, in its priority lane when `priority` (the request's
    /// [`Ticket`](super::fair_share::Ticket) says).
    pub fn submit(&self, mut req: Request, priority: bool) -> Handle<RequestOutput> {
        req.adapter = self.has_adapter.then(|| self.id.clone());
        req.priority = priority;
        self.engine.submit(req)
    }
}
