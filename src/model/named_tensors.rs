//! Tensors by name: the one type every loader, saver and weight update takes tensors from.
//!
//! Model weights, LoRA adapters, worker checkpoints and engine weight updates all hand over a
//! set of named tensors that the receiver takes one by one, checking each name and shape, and
//! then refuses anything left over. [`NamedTensors`] does that once, with one error wording:
//! every error names the tensor and where it came from (its file, or the label of an in-memory
//! set such as a weight update).
//!
//! Files are safetensors; a model directory holds either `model.safetensors` or a sharded set
//! described by `model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`).
//! Only float tensors are accepted (f32, bf16, f16, f64); [`NamedTensors::take`] converts them to
//! the dtype the receiver asks for.

use std::collections::{btree_map, BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::weights::{INDEX_FILE, SINGLE_FILE};
use crate::{Error, Result};

/// Tensors ordered by name, each remembering where it came from.
#[derive(Debug, Clone)]
pub struct NamedTensors {
    /// Tensor and the file (or label) it came from.
    tensors: BTreeMap<String, (Tensor, PathBuf)>,
    /// Where the set as a whole came from, for "missing" errors: a file, a directory, an index,
    /// or a label such as "weight update".
    source: PathBuf,
}

type Entry = (Tensor, PathBuf);
type EntryIter<'a> = btree_map::Iter<'a, String, Entry>;

impl NamedTensors {
    /// An empty set; `source` names it in errors.
    pub fn new(source: impl Into<PathBuf>) -> Self {
        NamedTensors { tensors: BTreeMap::new(), source: source.into() }
    }

    /// A set of in-memory tensors; a name given twice is an error.
    pub fn from_vec(source: impl Into<PathBuf>, tensors: Vec<(String, Tensor)>) -> Result<Self> {
        let mut out = Self::new(source);
        for (name, t) in tensors {
            out.insert(name, t)?;
        }
        Ok(out)
    }

    /// Adds a tensor coming from this set's source; a name already present is an error (a silent
    /// replacement would hide a mix-up of two tensors).
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) -> Result<()> {
        let path = self.source.clone();
        self.insert_from(name.into(), tensor, path)
    }

    fn insert_from(&mut self, name: String, tensor: Tensor, path: PathBuf) -> Result<()> {
        match self.tensors.entry(name) {
            btree_map::Entry::Occupied(e) => {
                Err(Error::tensor(&path, e.key(), format!("given twice (also in {})", e.get().1.display())))
            }
            btree_map::Entry::Vacant(e) => {
                e.insert((tensor, path));
                Ok(())
            }
        }
    }

    /// Moves every tensor of `other` into this set (each keeps its own file); a name present in
    /// both is an error.
    pub fn extend(&mut self, other: NamedTensors) -> Result<()> {
        for (name, (t, path)) in other.tensors {
            self.insert_from(name, t, path)?;
        }
        Ok(())
    }

    /// Every tensor of one safetensors file.
    pub fn load_file(path: &Path, device: &Device) -> Result<Self> {
        if !path.exists() {
            return Err(Error::file(path, "no such file"));
        }
        let tensors = super::safetensors_file::read_tensors(path, device)?;
        let mut out = Self::new(path);
        for (name, t) in tensors {
            if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16 | DType::F64) {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!("unsupported dtype {:?} (expected f32, bf16 or f16)", t.dtype()),
                ));
            }
            out.insert(name, t)?;
        }
        Ok(out)
    }

    /// The weights of a Hugging Face model directory: `model.safetensors`, or the shards that
    /// `model.safetensors.index.json` lists (only the tensors it maps to each shard are taken).
    pub fn load_dir(dir: &Path, device: &Device) -> Result<Self> {
        let single = dir.join(SINGLE_FILE);
        if single.exists() {
            return Self::load_file(&single, device);
        }
        let index = dir.join(INDEX_FILE);
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
        let mut out = Self::new(&index);
        for (file, names) in shards {
            let path = dir.join(&file);
            if !path.exists() {
                let more = if names.len() > 1 { format!(" and {} more", names.len() - 1) } else { String::new() };
                return Err(Error::file(
                    &path,
                    format!("no such file (named in {INDEX_FILE} for `{}`{more})", names[0]),
                ));
            }
            let mut shard = Self::load_file(&path, device)?;
            for name in names {
                let t = shard.remove(&name).ok_or_else(|| {
                    Error::tensor(&path, &name, format!("listed in {INDEX_FILE} but not in the shard"))
                })?;
                out.insert_from(name, t, path.clone())?;
            }
        }
        Ok(out)
    }

    /// Writes every tensor to one safetensors file, as they are (no dtype conversion), through a
    /// temporary file renamed into place so that a crash never leaves a half-written file.
    pub fn save_file(&self, path: &Path) -> Result<()> {
        let tensors = self.iter().map(|(n, t)| Ok((n, t.contiguous()?))).collect::<Result<Vec<_>>>()?;
        let tmp = path.with_extension("safetensors.tmp");
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(tensors, Some(metadata), &tmp)
            .map_err(|e| Error::file(&tmp, format!("cannot write: {e}")))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::file(path, format!("cannot rename into place: {e}")))?;
        Ok(())
    }

    /// Removes and returns the tensor `name`, checked to have `shape` and converted to `dtype`
    /// (a tensor already in `dtype` is returned as is, sharing its storage).
    pub fn take(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let (t, path) = self.tensors.remove(name).ok_or_else(|| Error::tensor(&self.source, name, "missing"))?;
        if t.dims() != shape {
            return Err(Error::tensor(&path, name, format!("has shape {:?}, expected {:?}", t.dims(), shape)));
        }
        Ok(t.to_dtype(dtype)?)
    }

    /// Fails on the first (by name) tensor still here that `allow` does not accept: a tensor
    /// nobody took is a sign of a mismatched config, and silently dropping it would hide that.
    /// `why` completes "unexpected tensor: …" (e.g. "not part of this model's config").
    pub fn reject_leftovers(&self, allow: impl Fn(&str) -> bool, why: &str) -> Result<()> {
        match self.tensors.iter().find(|(name, _)| !allow(name)) {
            Some((name, (_, path))) => Err(Error::tensor(path, name, format!("unexpected tensor: {why}"))),
            None => Ok(()),
        }
    }

    /// Removes and returns a tensor as it is, unchecked.
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.tensors.remove(name).map(|(t, _)| t)
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name).map(|(t, _)| t)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// What the set as a whole came from (a file, directory, index or label).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Where the tensor `name` came from.
    pub fn path_of(&self, name: &str) -> Option<&Path> {
        self.tensors.get(name).map(|(_, p)| p.as_path())
    }

    /// The names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// (name, tensor) in name order.
    pub fn iter(&self) -> Iter<'_> {
        Iter(self.tensors.iter())
    }

    /// Every tensor converted to `dtype` (e.g. for writing f32 files from a bf16 model).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        self.map(|_, t| Ok(t.to_dtype(dtype)?))
    }

    /// Every tensor replaced by `f(name, tensor)`, each keeping where it came from.
    pub fn map(&self, mut f: impl FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<Self> {
        let mut out = Self::new(&self.source);
        for (name, (t, path)) in &self.tensors {
            out.tensors.insert(name.clone(), (f(name, t)?, path.clone()));
        }
        Ok(out)
    }
}

/// Iterator over (name, tensor) in name order.
pub struct Iter<'a>(EntryIter<'a>);

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a str, &'a Tensor);
    fn next(&mut self) -> Option<Self::Item> {
        self.0.next().map(|(n, (t, _))| (n.as_str(), t))
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl<'a> IntoIterator for &'a NamedTensors {
    type Item = (&'a str, &'a Tensor);
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl IntoIterator for NamedTensors {
    type Item = (String, Tensor);
    type IntoIter = std::iter::Map<btree_map::IntoIter<String, Entry>, fn((String, Entry)) -> (String, Tensor)>;
    fn into_iter(self) -> Self::IntoIter {
        self.tensors.into_iter().map(|(n, (t, _))| (n, t))
    }
}
