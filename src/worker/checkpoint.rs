//! Worker checkpoints (`save_state` / `load_state`) and weight export.
//!
//! A state directory holds, each part in its usual layout and in the model's own dtype (so a
//! round trip is bit-exact):
//! - full fine-tuning: `config.json` + `model.safetensors` (HF layout: `Transformer::load` reads
//!   it back as a model); LoRA: `adapter_config.json` + `adapter_model.safetensors` (PEFT
//!   layout; the frozen base is not stored — load into a worker built on the same base);
//! - critic: `value_head.safetensors`;
//! - `optimizer.safetensors`: `exp_avg.NAME`, `exp_avg_sq.NAME` per parameter with state;
//! - `worker_state.json`: step, per-parameter AdamW step counts, RNG `(seed, draws)`, critic flag.
//!
//! Everything is written to a sibling temporary directory which is then renamed into place; an
//! existing checkpoint of the same name is first renamed aside and removed after the swap, so a
//! crash leaves either the old or the new complete checkpoint (in the worst case under the
//! aside name), never a half one. Accumulated gradients are not saved; loading drops them.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use serde_json::{json, Value};

use super::adamw::Moments;
use super::rank::Worker;
use super::rng::WorkerRng;
use super::value_head;
use crate::files::{read_json, write_dir_atomically, write_json};
use crate::model::{lora, weights};
use crate::{Error, Result};

const STATE_FILE: &str = "worker_state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const VALUE_HEAD_FILE: &str = "value_head.safetensors";
const FORMAT: &str = "oxrl-worker-state-v1";

impl Worker {
    /// Writes the full training state to `dir` (atomically, see the module documentation).
    pub fn save_state(&self, dir: &Path) -> Result<()> {
        write_dir_atomically(dir, |tmp| {
            self.write_params(tmp)?;
            let mut optimizer = vec![];
            let mut param_steps = serde_json::Map::new();
            for ((name, _), moments) in self.params.iter().zip(&self.moments) {
                if let Some(m) = moments {
                    optimizer.push((format!("exp_avg.{name}"), m.exp_avg.clone()));
                    optimizer.push((format!("exp_avg_sq.{name}"), m.exp_avg_sq.clone()));
                    param_steps.insert(name.clone(), json!(m.step));
                }
            }
            weights::save_file(&optimizer, &tmp.join(OPTIMIZER_FILE), None)?;
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
        if state["format"] != FORMAT {
            return Err(Error::field(&state_path, "format", format!("expected `{FORMAT}`, got {}", state["format"])));
        }
        let flag = |key: &str, want: bool| -> Result<()> {
            if state[key].as_bool() != Some(want) {
                return Err(Error::field(
                    &state_path,
                    key,
                    format!("the checkpoint has {}, this worker {want}", state[key]),
                ));
            }
            Ok(())
        };
        flag("critic", self.value_head.is_some())?;
        flag("lora", self.config.lora.is_some())?;
        if let Some(cfg) = &self.config.lora {
            let path = dir.join(lora::CONFIG_FILE);
            let saved = lora::LoraConfig::from_file(&path)?;
            if &saved != cfg {
                return Err(Error::file(path, format!("LoRA config {saved:?} differs from this worker's {cfg:?}")));
            }
        }
        let u64_field = |v: &Value, key: &str| -> Result<u64> {
            v.as_u64().ok_or_else(|| Error::field(&state_path, key, "missing or not a non-negative integer"))
        };
        let step = u64_field(&state["step"], "step")?;
        let rng = WorkerRng {
            seed: u64_field(&state["rng"]["seed"], "rng.seed")?,
            draws: u64_field(&state["rng"]["draws"], "rng.draws")?,
        };

        // Read everything before changing anything, so a bad checkpoint leaves the worker as it was.
        let mut tensors = HashMap::new();
        for file in self.param_files() {
            let path = dir.join(file);
            for (name, t) in weights::load_file(&path, &self.model.device)? {
                tensors.insert(name, (t, path.clone()));
            }
        }
        let opt_path = dir.join(OPTIMIZER_FILE);
        let mut optimizer = weights::load_file(&opt_path, &self.model.device)?;
        let mut values = Vec::with_capacity(self.params.len());
        let mut moments = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            let (t, path) =
                tensors.remove(name).ok_or_else(|| Error::tensor(dir, name, "missing from the checkpoint"))?;
            values.push(checked(&path, name, t, var.as_tensor())?);
            moments.push(match state["param_steps"].get(name) {
                None => None,
                Some(s) => {
                    let step = u64_field(s, &format!("param_steps.{name}"))?;
                    let mut take = |prefix: &str| -> Result<Tensor> {
                        let key = format!("{prefix}.{name}");
                        let t = optimizer.remove(&key).ok_or_else(|| Error::tensor(&opt_path, &key, "missing"))?;
                        let zeros = Moments::zeros(var.as_tensor())?;
                        checked(&opt_path, &key, t, &zeros.exp_avg)
                    };
                    Some(Moments { exp_avg: take("exp_avg")?, exp_avg_sq: take("exp_avg_sq")?, step })
                }
            });
        }
        let leftover = tensors
            .iter()
            .map(|(n, (_, p))| (n.clone(), p.clone()))
            .chain(optimizer.keys().map(|n| (n.clone(), opt_path.clone())));
        for (name, path) in leftover {
            let tied_head = name == "lm_head.weight" && self.model.config.tie_word_embeddings;
            if !tied_head {
                return Err(Error::tensor(path, &name, "unexpected tensor: not a parameter of this worker"));
            }
        }
        for ((_, var), value) in self.params.iter().zip(&values) {
            var.set(value)?;
        }
        self.moments = moments;
        self.step = step;
        self.rng = rng;
        self.zero_grad();
        Ok(())
    }

    /// Writes the weights for use elsewhere: full fine-tuning in the HF layout; LoRA in the PEFT
    /// layout, or with `merge_lora` the adapters folded into the base weights in the HF layout.
    /// A critic's value head goes to `value_head.safetensors` beside them. Atomic, like saving.
    pub fn export(&self, dir: &Path, merge_lora: bool) -> Result<()> {
        write_dir_atomically(dir, |tmp| {
            let mut model = self.model.clone();
            match &self.config.lora {
                Some(cfg) if !merge_lora => lora::save_peft(&mut model, cfg, tmp)?,
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
        let mut model = self.model.clone();
        match &self.config.lora {
            Some(cfg) => {
                // Native dtype (save_peft writes f32), so that the round trip is exact.
                weights::save_file(&lora::adapter_tensors(&mut model), &dir.join(lora::WEIGHTS_FILE), None)?;
                write_json(&dir.join(lora::CONFIG_FILE), &cfg.to_peft_json(model.config.arch.hf_class()))?;
            }
            None => model.save(dir, model.dtype)?,
        }
        self.write_value_head(dir)
    }

    fn write_value_head(&self, dir: &Path) -> Result<()> {
        if let Some(head) = &self.value_head {
            let tensors = vec![
                (value_head::WEIGHT.to_string(), head.weight.as_tensor().clone()),
                (value_head::BIAS.to_string(), head.bias.as_tensor().clone()),
            ];
            weights::save_file(&tensors, &dir.join(VALUE_HEAD_FILE), None)?;
        }
        Ok(())
    }
}

/// `t` checked against the shape of `like` and converted to its dtype.
fn checked(path: &Path, name: &str, t: Tensor, like: &Tensor) -> Result<Tensor> {
    if t.dims() != like.dims() {
        return Err(Error::tensor(path, name, format!("has shape {:?}, expected {:?}", t.dims(), like.dims())));
    }
    Ok(t.to_dtype(like.dtype())?)
}
