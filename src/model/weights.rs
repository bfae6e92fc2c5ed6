//! Reading and writing safetensors weights in the Hugging Face layout.
//!
//! A model directory holds either `model.safetensors` or a sharded set described by
//! `model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`). Tensors stored
//! as f32, bf16 or f16 are converted to the run dtype on load. Every error names the file and,
//! where one is at fault, the tensor.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Tensors by name, each remembering the file it came from (for error messages).
pub struct LoadedWeights {
    pub tensors: HashMap<String, (Tensor, PathBuf)>,
    /// Where the weights were looked for, for "missing tensor" errors.
    pub source: PathBuf,
}

impl LoadedWeights {
    /// Removes and returns a tensor, checked against the expected shape and converted to `dtype`.
    pub fn take(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let (t, path) = self
            .tensors
            .remove(name)
            .ok_or_else(|| Error::tensor(&self.source, name, "missing from the checkpoint"))?;
        if t.dims() != shape {
            return Err(Error::tensor(&path, name, format!("has shape {:?}, expected {:?}", t.dims(), shape)));
        }
        Ok(t.to_dtype(dtype)?)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Loads every tensor of a single safetensors file, checking that each is a float type.
pub fn load_file(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    if !path.exists() {
        return Err(Error::file(path, "no such file"));
    }
    let tensors = candle_core::safetensors::load(path, device)
        .map_err(|e| Error::file(path, format!("not a valid safetensors file: {e}")))?;
    for (name, t) in &tensors {
        if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16 | DType::F64) {
            return Err(Error::tensor(
                path,
                name,
                format!("unsupported dtype {:?} (expected f32, bf16 or f16)", t.dtype()),
            ));
        }
    }
    Ok(tensors)
}

/// Loads the weights of a model directory (single file or sharded).
pub fn load_dir(dir: &Path, device: &Device) -> Result<LoadedWeights> {
    let index = dir.join(INDEX_FILE);
    let single = dir.join(SINGLE_FILE);
    let mut out = HashMap::new();
    if single.exists() {
        for (name, t) in load_file(&single, device)? {
            out.insert(name, (t, single.clone()));
        }
        return Ok(LoadedWeights { tensors: out, source: single });
    }
    if !index.exists() {
        return Err(Error::file(dir, format!("neither {SINGLE_FILE} nor {INDEX_FILE} found")));
    }
    let json = crate::files::read_json(&index)?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::field(&index, "weight_map", "missing or not an object"))?;
    let mut shards: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, file) in map {
        let file =
            file.as_str().ok_or_else(|| Error::field(&index, &format!("weight_map.{name}"), "not a file name"))?;
        shards.entry(file.to_string()).or_default().push(name.clone());
    }
    for (file, names) in shards {
        let path = dir.join(&file);
        if !path.exists() {
            let more = if names.len() > 1 { format!(" and {} more", names.len() - 1) } else { String::new() };
            return Err(Error::file(&path, format!("no such file (named in {INDEX_FILE} for `{}`{more})", names[0])));
        }
        let mut tensors = load_file(&path, device)?;
        for name in names {
            let t = tensors
                .remove(&name)
                .ok_or_else(|| Error::tensor(&path, &name, format!("listed in {INDEX_FILE} but not in the shard")))?;
            out.insert(name, (t, path.clone()));
        }
    }
    Ok(LoadedWeights { tensors: out, source: index })
}

/// Writes tensors to one safetensors file, through a temporary file renamed into place.
pub fn save_file(tensors: &[(String, Tensor)], path: &Path, metadata: Option<HashMap<String, String>>) -> Result<()> {
    let mut map = HashMap::new();
    for (name, t) in tensors {
        map.insert(name.clone(), t.contiguous()?);
    }
    let tmp = path.with_extension("safetensors.tmp");
    let data: Vec<(&String, &Tensor)> = map.iter().collect();
    let metadata = metadata.unwrap_or_else(|| HashMap::from([("format".into(), "pt".into())]));
    safetensors::serialize_to_file(data, Some(metadata), &tmp)
        .map_err(|e| Error::file(&tmp, format!("cannot write: {e}")))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::file(path, format!("cannot rename into place: {e}")))?;
    Ok(())
}

/// Parses a dtype name as used in configs and on the command line.
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        "f64" | "float64" => Ok(DType::F64),
        _ => Err(Error::input(format!("unknown dtype `{name}` (expected f32, bf16, f16 or f64)"))),
    }
}

pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}
