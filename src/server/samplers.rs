//! Sampling sessions: a sampler is the served base model with, optionally, a LoRA adapter from a
//! checkpoint directory (PEFT layout), on a continuous-batching [`Engine`].
//!
//! Today each sampler with an adapter runs its own engine (the base weights are shared in
//! memory; the KV caches and the engine threads are not); samplers of the bare base share one
//! engine. The target is one engine batch with a per-request adapter — a rollout-layer
//! change; this module is where it plugs in (`Samplers::submit`).

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::errors::{ApiError, ApiResult};
use super::models::ServedModel;
use crate::handle::Handle;
use crate::model::tokenizer::Tokenizer;
use crate::model::{lora, Transformer};
use crate::rollout::{Engine, EngineConfig, Request, RequestOutput};

pub struct Sampler {
    pub id: String,
    pub base: ServedModel,
    /// The `tinker://` path it samples from (None: the bare base model).
    pub model_path: Option<String>,
    engine: Arc<Engine>,
}

/// A loaded base model, its tokenizer (for stop strings) and EOS ids.
type Base = (Transformer, Option<Arc<Tokenizer>>, Vec<u32>);

#[derive(Default)]
pub struct Samplers {
    /// Loaded base models by served name (their tensors are shared by every engine).
    bases: Mutex<HashMap<String, Base>>,
    /// Engines of the bare bases, by served name.
    base_engines: Mutex<HashMap<String, Arc<Engine>>>,
    samplers: Mutex<HashMap<String, Arc<Sampler>>>,
    /// Ephemeral samplers (from `save_weights_and_get_sampling_client`), oldest first, with the
    /// directory of their adapter.
    ephemeral: Mutex<VecDeque<(String, PathBuf)>>,
}

/// Ephemeral samplers kept at most (an RL loop makes one per iteration); the oldest is dropped
/// (its engine stopped, its adapter files removed) and later requests to it are unknown ids.
pub const MAX_EPHEMERAL: usize = 32;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Samplers {
    pub fn get(&self, id: &str) -> ApiResult<Arc<Sampler>> {
        lock(&self.samplers).get(id).cloned().ok_or_else(|| ApiError::not_found(format!("no sampling session `{id}`")))
    }

    fn base(&self, base: &ServedModel) -> crate::Result<Base> {
        if let Some(b) = lock(&self.bases).get(&base.name) {
            return Ok(b.clone());
        }
        let model = Transformer::load(&base.path, candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let tokenizer = Tokenizer::from_dir(&base.path).ok().map(Arc::new);
        let eos = match &tokenizer {
            Some(t) => t.eos_token_ids().to_vec(),
            None => model.config.eos_token_ids.clone(),
        };
        let entry = (model, tokenizer, eos);
        lock(&self.bases).insert(base.name.clone(), entry.clone());
        Ok(entry)
    }

    fn engine(&self, model: Transformer, tokenizer: Option<Arc<Tokenizer>>, eos: Vec<u32>) -> crate::Result<Engine> {
        Engine::start(model, EngineConfig { eos_token_ids: eos, tokenizer, threads: 1, ..Default::default() })
    }

    /// Creates sampler `id` over `base` with the adapter in `adapter_dir` (blocking: loads
    /// weights and starts an engine). An existing id is returned as is.
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
        let (mut model, tokenizer, eos) = self.base(base)?;
        let engine = match adapter_dir {
            Some(dir) => {
                lora::load_peft(&mut model, dir, false)?;
                Arc::new(self.engine(model, tokenizer, eos)?)
            }
            None => {
                let existing = lock(&self.base_engines).get(&base.name).cloned();
                match existing {
                    Some(e) => e,
                    None => {
                        let e = Arc::new(self.engine(model, tokenizer, eos)?);
                        lock(&self.base_engines).insert(base.name.clone(), e.clone());
                        e
                    }
                }
            }
        };
        let sampler = Arc::new(Sampler { id: id.to_string(), base: base.clone(), model_path, engine });
        lock(&self.samplers).insert(id.to_string(), sampler.clone());
        Ok(sampler)
    }
}

impl Samplers {
    /// [`Samplers::create`] for an ephemeral sampler over the adapter in `dir` (blocking), then
    /// drops the oldest ephemeral samplers beyond [`MAX_EPHEMERAL`].
    pub fn create_ephemeral(&self, id: &str, base: &ServedModel, dir: &Path) -> crate::Result<Arc<Sampler>> {
        let sampler = self.create(id, base, Some(dir), None)?;
        let evicted: Vec<(String, PathBuf)> = {
            let mut q = lock(&self.ephemeral);
            q.push_back((id.to_string(), dir.to_path_buf()));
            let n = q.len().saturating_sub(MAX_EPHEMERAL);
            q.drain(..n).collect()
        };
        for (old, old_dir) in evicted {
            let dropped = lock(&self.samplers).remove(&old);
            drop(dropped); // stops its engine once no request holds it
            let _ = std::fs::remove_dir_all(old_dir);
        }
        Ok(sampler)
    }
}

impl Samplers {
    /// Drops the sampling sessions of session `session_id` (`{session_id}:sample:{n}`).
    pub fn drop_session(&self, session_id: &str) {
        let prefix = format!("{session_id}:sample:");
        let dropped: Vec<Arc<Sampler>> = {
            let mut samplers = lock(&self.samplers);
            let ids: Vec<String> = samplers.keys().filter(|k| k.starts_with(&prefix)).cloned().collect();
            ids.iter().filter_map(|id| samplers.remove(id)).collect()
        };
        lock(&self.ephemeral).retain(|(id, _)| !id.starts_with(&prefix));
        drop(dropped);
    }
}

impl Sampler {
    pub fn submit(&self, req: Request) -> Handle<RequestOutput> {
        self.engine.submit(req)
    }
}
