//! [`SamplerWeights`]: a versioned snapshot of a policy's weights, for the sampling engines.
//!
//! A worker makes one after its optimizer steps (`Worker::sampler_weights`): every base
//! parameter by HF name for full fine-tuning, or only the LoRA adapters (PEFT names) with their
//! config. The tensors are private copies in fresh storage, because the optimizer updates its
//! variables in place (`Var::set`): a snapshot that shared their storage would change under the
//! engine at the next `optim_step`. The snapshot itself is immutable and reference-counted, so
//! any number of engines take it without copying it again. `version` is the number of optimizer
//! steps behind these weights; engines stamp it on every token they sample with them.
//!
//! Across processes (an engine of its own, `oxrl engine`) a snapshot travels as one safetensors
//! file: the tensors as they are (no float ever printed), and in its metadata the version, the
//! kind and, for adapters, their config.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::lora::LoraConfig;
use super::named_tensors::NamedTensors;
use super::transformer::Transformer;
use super::weight_update::WeightUpdate;
use crate::{Error, Result};

#[derive(Clone, Debug)]
pub struct SamplerWeights {
    version: u64,
    update: Arc<WeightUpdate>,
}

impl SamplerWeights {
    /// The weights of `model` as an engine needs them: the adapters only when `lora` is given
    /// (the engine's base is the same frozen base), every base parameter otherwise.
    pub fn snapshot(model: &Transformer, lora: Option<&LoraConfig>, version: u64) -> Result<Self> {
        let update = match lora {
            Some(config) => WeightUpdate::lora_snapshot(model, config)?,
            None => WeightUpdate::full_snapshot(model)?,
        };
        Ok(SamplerWeights { version, update: Arc::new(update) })
    }

    /// Optimizer steps behind these weights.
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn update(&self) -> &WeightUpdate {
        &self.update
    }

    /// Weights made elsewhere (e.g. received from a trainer in another process).
    pub fn new(version: u64, update: WeightUpdate) -> Self {
        SamplerWeights { version, update: Arc::new(update) }
    }

    /// The snapshot as the bytes of one safetensors file (see the module docs).
    pub fn to_safetensors(&self) -> Result<Vec<u8>> {
        let mut meta = HashMap::from([("oxrl_version".to_string(), self.version.to_string())]);
        let tensors = match &*self.update {
            WeightUpdate::Full(t) => {
                meta.insert("oxrl_kind".into(), "full".into());
                t
            }
            WeightUpdate::Lora { config, tensors } => {
                meta.insert("oxrl_kind".into(), "lora".into());
                meta.insert("lora_rank".into(), config.rank.to_string());
                meta.insert("lora_alpha".into(), config.alpha.to_string());
                meta.insert("lora_targets".into(), config.target_modules.join(","));
                meta.insert("lora_rslora".into(), config.use_rslora.to_string());
                tensors
            }
        };
        let views: Vec<(&str, &Tensor)> = tensors.iter().collect();
        let bytes = safetensors::serialize(views, Some(meta))
            .map_err(|e| Error::Other(format!("weights to safetensors: {e}")))?;
        metadata_sorted(bytes)
    }

    /// The snapshot [`SamplerWeights::to_safetensors`] wrote, its tensors on `device`.
    pub fn from_safetensors(bytes: &[u8], device: &Device) -> Result<Self> {
        let bad = |why: String| Error::input(format!("weights (safetensors): {why}"));
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |k: &str| meta.get(k).ok_or_else(|| bad(format!("no `{k}` in the metadata")));
        let parse = |k: &str| -> Result<f64> { get(k)?.parse().map_err(|_| bad(format!("`{k}` is not a number"))) };
        let version = get("oxrl_version")?.parse().map_err(|_| bad("`oxrl_version` is not a number".into()))?;
        let loaded = candle_core::safetensors::load_buffer(bytes, device).map_err(|e| bad(e.to_string()))?;
        let mut named: Vec<(String, Tensor)> = loaded.into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let tensors = NamedTensors::from_vec("weights received", named)?;
        let update = match get("oxrl_kind")?.as_str() {
            "full" => WeightUpdate::Full(tensors),
            "lora" => {
                let targets: Vec<String> = get("lora_targets")?.split(',').map(String::from).collect();
                let config = LoraConfig {
                    rank: parse("lora_rank")? as usize,
                    alpha: parse("lora_alpha")?,
                    target_modules: targets,
                    use_rslora: get("lora_rslora")? == "true",
                };
                WeightUpdate::Lora { config, tensors }
            }
            other => return Err(bad(format!("unknown kind `{other}` (full or lora)"))),
        };
        Ok(SamplerWeights::new(version, update))
    }

    pub fn is_lora(&self) -> bool {
        matches!(*self.update, WeightUpdate::Lora { .. })
    }

    /// Total bytes of the tensors.
    pub fn num_bytes(&self) -> usize {
        let tensors = match &*self.update {
            WeightUpdate::Full(t) => t,
            WeightUpdate::Lora { tensors, .. } => tensors,
        };
        tensors.iter().map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}

/// safetensors writes the metadata map in its hash order, so the same snapshot would make other
/// bytes in another process or run. Rewrites the header with the metadata's keys sorted: the same
/// keys and values in another order, hence the same length, and the tensors' bytes untouched.
fn metadata_sorted(mut bytes: Vec<u8>) -> Result<Vec<u8>> {
    let bad = |why: &str| Error::Other(format!("weights to safetensors: {why}"));
    let n = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize);
    let n = n.filter(|&n| 8 + n <= bytes.len()).ok_or_else(|| bad("a header longer than the file"))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).map_err(|e| bad(&e.to_string()))?;
    let header: serde_json::Map<String, serde_json::Value> = header
        .into_iter()
        .map(|(k, v)| match (k.as_str(), v) {
            ("__metadata__", serde_json::Value::Object(m)) => {
                let sorted: std::collections::BTreeMap<String, serde_json::Value> = m.into_iter().collect();
                (k, serde_json::Value::Object(sorted.into_iter().collect()))
            }
            (_, v) => (k, v),
        })
        .collect();
    let mut json = serde_json::to_vec(&header).map_err(|e| bad(&e.to_string()))?;
    if json.len() > n {
        return Err(bad("the rewritten header is longer"));
    }
    json.resize(n, b' ');
    bytes[8..8 + n].copy_from_slice(&json);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A LoRA snapshot (six metadata keys) makes the same bytes every time it is written, and
    /// reads back to its version, config and tensors.
    #[test]
    fn the_same_snapshot_makes_the_same_bytes() {
        let mut tensors = NamedTensors::new("test");
        let a = Tensor::arange(0f32, 12., &Device::Cpu).unwrap().reshape((3, 4)).unwrap();
        tensors.insert("base_model.model.lm_head.lora_A.weight".to_string(), a.clone()).unwrap();
        let config = LoraConfig { rank: 3, alpha: 6.0, target_modules: vec!["lm_head".into()], use_rslora: false };
        let update = WeightUpdate::Lora { config: config.clone(), tensors };
        let first = SamplerWeights::new(7, update).to_safetensors().unwrap();
        for _ in 0..20 {
            let mut tensors = NamedTensors::new("test");
            tensors.insert("base_model.model.lm_head.lora_A.weight".to_string(), a.clone()).unwrap();
            let update = WeightUpdate::Lora { config: config.clone(), tensors };
            assert!(SamplerWeights::new(7, update).to_safetensors().unwrap() == first, "the bytes differ");
        }
        let back = SamplerWeights::from_safetensors(&first, &Device::Cpu).unwrap();
        assert_eq!(back.version(), 7);
        match back.update() {
            WeightUpdate::Lora { config: c, tensors } => {
                assert_eq!(c, &config);
                assert_eq!(tensors.len(), 1);
            }
            _ => panic!("not a LoRA update"),
        }
    }
}
