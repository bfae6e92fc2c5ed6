//! Worker checkpoints (`save_state` / `load_state`) and weight export.
//!
//! A state directory holds, each part in its usual layout and in the model's own dtype (so a
//! round trip is bit-exact):
//! - full fine-tuning: `config.json` + `model.safetensors` (HF layout: `Transformer::load` reads
//!   it back as a model); LoRA: `adapter_config.json` + `adapter_model.safetensors` (PEFT
//!   layout; the frozen base is not stored — load into a worker built on the same base);
//! - critic: `value_head.safetensors`;
//! - `optimizer.safetensors`: `exp_avg.NAME`, `exp_avg_sq.NAME` per parameter with state;
//! - mixed precision: `master_weights.safetensors`, the f32 masters by parameter name (the
//!   parameters above are their rounding); a worker with masters that loads a checkpoint
//!   without them takes the stored parameters, read in f32, as its masters;
//! - `worker_state.json`: step, per-parameter AdamW step counts, RNG `(seed, draws)`, critic flag.
//!
//! Everything is written to a sibling temporary directory which is then renamed into place; an
//! existing checkpoint of the same name is first renamed aside and removed after the swap, so a
//! crash leaves either the old or the new complete checkpoint (in the worst case under the
//! aside name), never a half one. Accumulated gradients are not saved; loading drops them.
//!
//! A sharded worker's state is saved through its group (`super::sharded_step`): the owners'
//! moments and masters are gathered and written in the same layout, so a checkpoint does not
//! depend on the sharding or the rank count that wrote it; loading keeps the owned part.

use std::path::Path;

use candle_core::Tensor;
use serde_json::{json, Value};

use super::adamw::{state_dtype, Moments};
use super::mixed_precision::{MASTER_DTYPE, MASTER_FILE};
use super::rng::WorkerRng;
use super::worker::Worker;
use crate::files::{read_json, write_dir_atomically, write_json, JsonFields};
use crate::model::{lora, weights, NamedTensors};
use crate::{Error, Result};

const STATE_FILE: &str = "worker_state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const VALUE_HEAD_FILE: &str = "value_head.safetensors";
const FORMAT: &str = "oxrl-worker-state-v1";
/// The AdamW moments stored per parameter, as `KIND.NAME`.
const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

fn moment_name(kind: &str, param: &str) -> String {
    format!("{kind}.{param}")
}

impl Worker {
    /// Writes the full training state to `dir` (atomically, see the module documentation).
    pub fn save_state(&self, dir: &Path) -> Result<()> {
        if self.shard.is_some() {
            return Err(Error::Other(
                "a sharded worker holds a slice of the optimizer state: save through its group".into(),
            ));
        }
        self.write_state(dir, &self.moments, self.masters.as_deref())
    }

    /// Writes the state with these moments and masters (by parameter: this worker's own, or
    /// the ones a sharded group gathered).
    pub(super) fn write_state(
        &self,
        dir: &Path,
        moments: &[Option<Moments>],
        masters: Option<&[Option<Tensor>]>,
    ) -> Result<()> {
        write_dir_atomically(dir, |tmp| {
            self.write_params(tmp)?;
            let path = tmp.join(OPTIMIZER_FILE);
            let mut optimizer = NamedTensors::new(&path);
            let mut param_steps = serde_json::Map::new();
            for ((name, _), moments) in self.params.iter().zip(moments) {
                if let Some(m) = moments {
                    for (kind, t) in MOMENTS.iter().zip([&m.exp_avg, &m.exp_avg_sq]) {
                        optimizer.insert(moment_name(kind, name), t.clone())?;
                    }
                    param_steps.insert(name.clone(), json!(m.step));
                }
            }
            optimizer.save_file(&path)?;
            if let Some(masters) = masters {
                let path = tmp.join(MASTER_FILE);
                let mut tensors = NamedTensors::new(&path);
                for ((name, _), m) in self.params.iter().zip(masters) {
                    let m = m.as_ref().ok_or_else(|| Error::Other(format!("no master weight of `{name}` to save")))?;
                    tensors.insert(name.clone(), m.clone())?;
                }
                tensors.save_file(&path)?;
            }
            let state = json!({
                "format": FORMAT,
                "step": self.step,
                "rng": {"seed": self.rng.seed, "draws": self.rng.draws},
                "critic": self.value_head.is_some(),
                "lora": self.config.lora.is_some(),
                "params": self.params.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
                "param_steps": param_steps,
            });
            write_json(&tmp.join(STATE_FILE), &state)
        })
    }

    /// Restores a state written by [`Worker::save_state`] into this worker, which must have the
    /// same trainable parameters (same base model, LoRA config and critic flag). Gradients are
    /// dropped.
    pub fn load_state(&mut self, dir: &Path) -> Result<()> {
        let state_path = dir.join(STATE_FILE);
        let state = read_json(&state_path)?;
        let f = JsonFields::new(&state_path, &state)?;
        if f.opt_str("format")? != Some(FORMAT) {
            return Err(f.err("format", format!("expected `{FORMAT}`, got {}", state["format"])));
        }
        for (key, want) in [("critic", self.value_head.is_some()), ("lora", self.config.lora.is_some())] {
            if f.opt_bool(key)? != Some(want) {
                return Err(f.err(key, format!("the checkpoint has {}, this worker {want}", state[key])));
            }
        }
        if let Some(cfg) = &self.config.lora {
            let path = dir.join(lora::CONFIG_FILE);
            let saved = lora::LoraConfig::from_file(&path)?;
            if &saved != cfg {
                let describe = |c: &lora::LoraConfig| {
                    let rs = if c.use_rslora { ", rsLoRA" } else { "" };
                    format!("rank {}, alpha {}, targets {}{rs}", c.rank, c.alpha, c.target_modules.join(" "))
                };
                return Err(Error::input(format!(
                    "{}: the checkpoint's LoRA adapter ({}) differs from this model's ({}): load it into a model \
                     created with the same LoRA settings",
                    dir.display(),
                    describe(&saved),
                    describe(cfg)
                )));
            }
        }
        // Nested fields are named by their dotted key (`rng.seed`).
        let nested_u64 = |v: &Value, key: &str| -> Result<u64> {
            v.as_u64().ok_or_else(|| f.err(key, format!("missing or not a non-negative integer: {v}")))
        };
        let step = f.u64("step")?;
        let rng = WorkerRng {
            seed: nested_u64(&state["rng"]["seed"], "rng.seed")?,
            draws: nested_u64(&state["rng"]["draws"], "rng.draws")?,
        };

        // Read everything before changing anything, so a bad checkpoint leaves the worker as it was.
        let device = &self.model.device;
        let mut tensors = NamedTensors::new(dir);
        for file in self.param_files() {
            tensors.extend(NamedTensors::load_file(&dir.join(file), device)?)?;
        }
        let mut optimizer = NamedTensors::load_file(&dir.join(OPTIMIZER_FILE), device)?;
        let master_path = dir.join(MASTER_FILE);
        let mut saved_masters = match (&self.masters, master_path.exists()) {
            (Some(_), true) => Some(NamedTensors::load_file(&master_path, device)?),
            _ => None,
        };
        let mut masters = Vec::with_capacity(self.params.len());
        let mut values = Vec::with_capacity(self.params.len());
        let mut moments = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            let p = var.as_tensor();
            let value = if self.masters.is_some() {
                // The parameter is the master rounded. Without saved masters, the master is the
                // stored parameter read in f32 (an f32 checkpoint keeps its low bits).
                let stored = tensors.take(name, p.dims(), MASTER_DTYPE)?;
                let master = match saved_masters.as_mut() {
                    Some(saved) => saved.take(name, p.dims(), MASTER_DTYPE)?,
                    None => stored,
                };
                let value = master.to_dtype(p.dtype())?;
                masters.push(Some(master));
                value
            } else {
                tensors.take(name, p.dims(), p.dtype())?
            };
            values.push(value);
            moments.push(match state["param_steps"].get(name) {
                None => None,
                Some(s) => {
                    let step = nested_u64(s, &format!("param_steps.{name}"))?;
                    let [exp_avg, exp_avg_sq] =
                        MOMENTS.map(|kind| optimizer.take(&moment_name(kind, name), p.dims(), state_dtype(p.dtype())));
                    Some(Moments { exp_avg: exp_avg?, exp_avg_sq: exp_avg_sq?, step })
                }
            });
        }
        let tied = self.model.config.tie_word_embeddings;
        tensors.reject_leftovers(|name| tied && name == "lm_head.weight", "not a parameter of this worker")?;
        optimizer.reject_leftovers(|_| false, "not the moment of a parameter of this worker")?;
        if let Some(saved) = &saved_masters {
            saved.reject_leftovers(|_| false, "not the master of a parameter of this worker")?;
        }
        for ((_, var), value) in self.params.iter().zip(&values) {
            // A weight another rank keeps (`full` sharding) is filled, then released again below.
            if crate::model::sharded_weights::is_released(var.as_tensor()) {
                crate::model::sharded_weights::fill(var.as_tensor(), value)?;
            } else {
                var.set(value)?;
            }
        }
        if self.masters.is_some() {
            self.masters = Some(masters);
        }
        self.moments = moments;
        self.step = step;
        self.rng = rng;
        self.zero_grad();
        self.drop_unowned_state();
        if let Some(slices) = &self.slices {
            slices.release_unowned()?;
        }
        Ok(())
    }

    /// Restores only the parameters of a state written by [`Worker::save_state`]: the optimizer
    /// starts afresh (no moments, step 0), as Tinker's `load_state` without optimizer does.
    pub fn load_weights(&mut self, dir: &Path) -> Result<()> {
        self.load_state(dir)?;
        self.moments = vec![None; self.params.len()];
        self.step = 0;
        Ok(())
    }

    /// Writes the weights for use elsewhere: full fine-tuning in the HF layout; LoRA in the PEFT
    /// layout, or with `merge_lora` the adapters folded into the base weights in the HF layout.
    /// A critic's value head goes to `value_head.safetensors` beside them. Atomic, like saving.
    pub fn export(&self, dir: &Path, merge_lora: bool) -> Result<()> {
        self.check_weights_whole("export")?;
        write_dir_atomically(dir, |tmp| {
            let mut model = self.model.clone();
            match &self.config.lora {
                Some(cfg) if !merge_lora => lora::save_peft(&model, cfg, tmp)?,
                Some(_) => {
                    lora::merge(&mut model)?;
                    model.save(tmp, model.dtype)?;
                }
                None => model.save(tmp, model.dtype)?,
            }
            self.write_value_head(tmp)
        })
    }

    fn param_files(&self) -> Vec<&'static str> {
        let mut files = vec![if self.config.lora.is_some() { lora::WEIGHTS_FILE } else { weights::SINGLE_FILE }];
        if self.value_head.is_some() {
            files.push(VALUE_HEAD_FILE);
        }
        files
    }

    fn write_params(&self, dir: &Path) -> Result<()> {
        let model = &self.model;
        match &self.config.lora {
            Some(cfg) => {
                // Native dtype (save_peft writes f32), so that the round trip is exact.
                lora::adapter_tensors(model)?.save_file(&dir.join(lora::WEIGHTS_FILE))?;
                write_json(&dir.join(lora::CONFIG_FILE), &cfg.to_peft_json(model.config.arch.hf_class()))?;
            }
            None => model.save(dir, model.dtype)?,
        }
        self.write_value_head(dir)
    }

    fn write_value_head(&self, dir: &Path) -> Result<()> {
        if let Some(head) = &self.value_head {
            let path = dir.join(VALUE_HEAD_FILE);
            let mut tensors = NamedTensors::new(&path);
            for (name, var) in head.vars() {
                tensors.insert(name, var.as_tensor().clone())?;
            }
            tensors.save_file(&path)?;
        }
        Ok(())
    }
}
