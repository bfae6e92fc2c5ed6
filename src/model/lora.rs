//! LoRA adapters (Hu et al. 2021) in the PEFT layout.
//!
//! A targeted projection y = x·Wᵀ becomes y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with A [r, in], B [out, r] and
//! s = alpha / r (alpha / √r with rsLoRA). Fresh adapters start with A ~ U(±1/√in) (PEFT's
//! kaiming-uniform with a = √5) and B = 0, so the model is unchanged at step 0. The base stays
//! frozen (plain tensors); only A and B are variables. Targets are module names matched as PEFT
//! does: a name equal to the target or ending in ".target"; "all-linear" means every projection
//! but lm_head. Files: `adapter_config.json` + `adapter_model.safetensors` with tensors named
//! `base_model.model.<module>.lora_{A,B}.weight`. Unsupported PEFT options (DoRA, per-layer rank
//! patterns, trained biases, modules_to_save) are refused by name rather than silently ignored.

use std::path::Path;

use candle_core::{DType, Tensor, Var};
use rand::{rngs::StdRng, SeedableRng};
use serde_json::{json, Value};

use super::init::uniform;
use super::linear::LoraPair;
use super::named_tensors::NamedTensors;
use super::transformer::Transformer;
use crate::files::{read_json, write_json, JsonFields};
use crate::{Error, Result};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
const PREFIX: &str = "base_model.model.";

/// The projection names a LoRA may target (the `in_proj_*` and `out_proj` of Qwen3.5's DeltaNet
/// layers among them).
pub const TARGETABLE: [&str; 13] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_a",
    "in_proj_b",
    "out_proj",
    "lm_head",
];

#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank r.
    pub rank: usize,
    /// Scale numerator; s = alpha / r.
    pub alpha: f64,
    /// Projection names (see [`TARGETABLE`]) or "all-linear".
    pub target_modules: Vec<String>,
    /// s = alpha / √r instead.
    pub use_rslora: bool,
}

impl LoraConfig {
    pub fn new(rank: usize, alpha: f64, target_modules: &[&str]) -> Self {
        LoraConfig {
            rank,
            alpha,
            target_modules: target_modules.iter().map(|s| s.to_string()).collect(),
            use_rslora: false,
        }
    }

    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::input("LoRA rank must be positive"));
        }
        if self.target_modules.is_empty() {
            return Err(Error::input("LoRA target_modules is empty"));
        }
        for t in &self.target_modules {
            if t != "all-linear" && !TARGETABLE.contains(&t.as_str()) {
                return Err(Error::input(format!(
                    "unknown LoRA target module `{t}` (valid: {}, all-linear)",
                    TARGETABLE.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// Whether the module (full name, e.g. `model.layers.0.self_attn.q_proj`) is targeted.
    pub fn targets(&self, module: &str) -> bool {
        self.target_modules.iter().any(|t| {
            if t == "all-linear" {
                module != "lm_head"
            } else {
                module == t || module.ends_with(&format!(".{t}"))
            }
        })
    }

    /// Reads a PEFT `adapter_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let v = read_json(path)?;
        let f = JsonFields::new(path, &v)?;
        if let Some(t) = f.get("peft_type") {
            if t.as_str() != Some("LORA") {
                return Err(f.err("peft_type", format!("{t} is not supported (only LORA)")));
            }
        }
        let rank = f.usize("r")?;
        if rank == 0 {
            return Err(f.err("r", "the LoRA rank must be positive"));
        }
        let alpha = f.f64("lora_alpha")?;
        let target_modules = match f.get("target_modules") {
            Some(Value::Array(xs)) => xs
                .iter()
                .map(|x| x.as_str().map(String::from).ok_or_else(|| f.err("target_modules", "expected strings")))
                .collect::<Result<Vec<_>>>()?,
            Some(Value::String(s)) if s == "all-linear" => vec![s.clone()],
            Some(other) => {
                return Err(
                    f.err("target_modules", format!("{other} is not supported (a list of names or \"all-linear\")"))
                )
            }
            None => return Err(f.err("target_modules", "missing (required)")),
        };
        for k in ["use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "lora_bias"] {
            match f.get(k) {
                None | Some(Value::Bool(false)) => {}
                Some(Value::Object(m)) if m.is_empty() => {}
                Some(Value::Array(a)) if a.is_empty() => {}
                Some(x) => return Err(f.err(k, format!("{x} is not supported"))),
            }
        }
        if let Some(b) = f.get("bias") {
            if b.as_str() != Some("none") {
                return Err(f.err("bias", format!("{b} is not supported (only \"none\")")));
            }
        }
        let use_rslora = f.bool_or("use_rslora", false)?;
        let cfg = LoraConfig { rank, alpha, target_modules, use_rslora };
        cfg.validate().map_err(|e| f.err("target_modules", e))?;
        Ok(cfg)
    }

    pub fn to_peft_json(&self, base_model_class: &str) -> Value {
        // PEFT knows "all-linear" only as a plain string, not inside a list.
        let targets = if self.target_modules.iter().any(|t| t == "all-linear") {
            json!("all-linear")
        } else {
            json!(self.target_modules)
        };
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": targets,
            "use_rslora": self.use_rslora,
            "use_dora": false,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "modules_to_save": null,
            "base_model_name_or_path": null,
            "auto_mapping": {"base_model_class": base_model_class, "parent_library": "transformers"},
            "revision": null,
        })
    }
}

/// The MLP projections PEFT maps onto a Qwen3-MoE's experts.
const MOE_MLP: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// The PEFT names of a module's (A, B) adapter tensors: `base_model.model.<module>.lora_{A,B}.weight`.
/// The one place these names are built.
pub fn adapter_names(module: &str) -> (String, String) {
    (format!("{PREFIX}{module}.lora_A.weight"), format!("{PREFIX}{module}.lora_B.weight"))
}

/// Gives the (A, B) tensors of a module: `source(module, out, in)`.
type AdapterSource<'a> = dyn FnMut(&str, usize, usize) -> Result<(Tensor, Tensor)> + 'a;

/// Attaches adapters to every targeted projection, asking `source(module, out, in)` for (A, B),
/// and removes any adapter from the projections `cfg` does not target: the new adapters replace
/// whatever the model had.
fn attach_with(
    model: &mut Transformer,
    cfg: &LoraConfig,
    trainable: bool,
    source: &mut AdapterSource,
) -> Result<Vec<(String, Var)>> {
    cfg.validate()?;
    // PEFT (over transformers ≥ 5) takes a Qwen3-MoE's MLP names for its experts' fused weights,
    // which oxrl does not adapt: with experts, adapters go on the attention only.
    let moe_mlp = |module: &str| MOE_MLP.iter().any(|m| module.ends_with(&format!(".{m}")));
    if model.config.moe.is_some() {
        if let Some(t) = cfg.target_modules.iter().find(|t| MOE_MLP.contains(&t.as_str())) {
            return Err(Error::input(format!(
                "LoRA target `{t}` on a model with experts: PEFT applies it to the experts, which oxrl \
                 does not adapt (target the attention's q_proj, k_proj, v_proj, o_proj, or all-linear)"
            )));
        }
    }
    let experts = model.config.moe.is_some();
    let mut vars = vec![];
    let mut attached = 0;
    for (module, lin) in model.linears_mut() {
        if !cfg.targets(&module) || (experts && moe_mlp(&module)) {
            lin.lora = None;
            continue;
        }
        let (out, inp) = lin.weight.dims2()?;
        let (mut a, mut b) = source(&module, out, inp)?;
        if trainable {
            let (va, vb) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
            a = va.as_tensor().clone();
            b = vb.as_tensor().clone();
            let (a_name, b_name) = adapter_names(&module);
            vars.push((a_name, va));
            vars.push((b_name, vb));
        }
        lin.lora = Some(LoraPair { a, b, scale: cfg.scale() });
        attached += 1;
    }
    if attached == 0 {
        return Err(Error::input(format!(
            "LoRA target_modules {:?} match no projection of the model",
            cfg.target_modules
        )));
    }
    Ok(vars)
}

/// Fresh trainable adapters (A uniform, B zero): returns the variables by PEFT name.
pub fn attach_new(model: &mut Transformer, cfg: &LoraConfig, seed: u64) -> Result<Vec<(String, Var)>> {
    model.check_trainable()?;
    let (dtype, device) = (model.dtype, model.device.clone());
    let mut rng = StdRng::seed_from_u64(seed);
    attach_with(model, cfg, true, &mut |_, out, inp| {
        let a = uniform(&mut rng, &[cfg.rank, inp], 1.0 / (inp as f64).sqrt(), dtype, &device)?;
        Ok((a, Tensor::zeros((out, cfg.rank), dtype, &device)?))
    })
}

/// Attaches the adapters `tensors` holds by PEFT name (converted to the model's dtype), one pair
/// for every module `cfg` targets; they replace whatever adapters the model had. A tensor left
/// over is an error. With `trainable` the adapters are variables, returned by PEFT name. On
/// error the model may be half-changed: callers that must not change it work on a clone.
pub fn attach_tensors(
    model: &mut Transformer,
    cfg: &LoraConfig,
    tensors: &mut NamedTensors,
    trainable: bool,
) -> Result<Vec<(String, Var)>> {
    let (dtype, r) = (model.dtype, cfg.rank);
    let vars = attach_with(model, cfg, trainable, &mut |module, out, inp| {
        let (a_name, b_name) = adapter_names(module);
        Ok((tensors.take(&a_name, &[r, inp], dtype)?, tensors.take(&b_name, &[out, r], dtype)?))
    })?;
    tensors.reject_leftovers(|_| false, "not an adapter the LoRA config targets")?;
    Ok(vars)
}

/// Loads a PEFT adapter directory onto the model; with `trainable` the adapters are variables.
pub fn load_peft(model: &mut Transformer, dir: &Path, trainable: bool) -> Result<(LoraConfig, Vec<(String, Var)>)> {
    let cfg = LoraConfig::from_file(&dir.join(CONFIG_FILE))?;
    let mut tensors = NamedTensors::load_file(&dir.join(WEIGHTS_FILE), &model.device)?;
    let vars = attach_tensors(model, &cfg, &mut tensors, trainable)?;
    Ok((cfg, vars))
}

/// The adapter tensors by PEFT name (sharing the model's storage).
pub fn adapter_tensors(model: &Transformer) -> Result<NamedTensors> {
    let mut out = NamedTensors::new("LoRA adapters");
    // `linears_mut` on a clone (cheap: tensors are shared) rather than a second, shared-borrow
    // list of the projections.
    for (module, lin) in model.clone().linears_mut() {
        if let Some(l) = &lin.lora {
            let (a_name, b_name) = adapter_names(&module);
            out.insert(a_name, l.a.clone())?;
            out.insert(b_name, l.b.clone())?;
        }
    }
    Ok(out)
}

/// Writes the adapters in the PEFT layout (f32 tensors).
pub fn save_peft(model: &Transformer, cfg: &LoraConfig, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create: {e}")))?;
    let tensors = adapter_tensors(model)?;
    if tensors.is_empty() {
        return Err(Error::input("the model has no LoRA adapters to save"));
    }
    tensors.to_dtype(DType::F32)?.save_file(&dir.join(WEIGHTS_FILE))?;
    let mut json = cfg.to_peft_json(model.config.arch.hf_class());
    // PEFT's "all-linear" on a model with experts also adapts its routers and experts, which are
    // not oxrl's projections: the file names the projections that have adapters instead.
    if model.config.moe.is_some() && cfg.target_modules.iter().any(|t| t == "all-linear") {
        let mut names: Vec<String> = vec![];
        for (module, lin) in model.clone().linears_mut() {
            let name = module.rsplit('.').next().unwrap_or(&module).to_string();
            if lin.lora.is_some() && !names.contains(&name) {
                names.push(name);
            }
        }
        names.sort();
        json["target_modules"] = json!(names);
    }
    write_json(&dir.join(CONFIG_FILE), &json)
}

/// Folds every adapter into its base weight (W + s·B·A) and removes the adapters.
pub fn merge(model: &mut Transformer) -> Result<()> {
    let tied = model.config.tie_word_embeddings;
    let mut new_embed = None;
    for (module, lin) in model.linears_mut() {
        if lin.lora.is_some() {
            lin.weight = lin.merged_weight()?;
            lin.lora = None;
            if module == "lm_head" && tied {
                new_embed = Some(lin.weight.clone());
            }
        }
    }
    if let Some(e) = new_embed {
        model.embed_tokens = e;
    }
    Ok(())
}
