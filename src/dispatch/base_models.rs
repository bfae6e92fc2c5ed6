//! Frozen base weights shared by every model that trains LoRA adapters over them.
//!
//! Models are keyed by (directory, dtype, device). The first LoRA model over a base loads it;
//! the others get a clone of the same `Transformer`, whose tensors share storage (candle tensors
//! are reference-counted), so N adapters over one base hold the base once. The base is frozen —
//! adapters are attached to each clone, never to the shared tensors — and dropped when its last
//! user is. Full fine-tuning copies the weights into its own variables, so it does not use this.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{DType, Device};

use crate::locks::lock;
use crate::model::Transformer;
use crate::Result;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct BaseKey {
    dir: PathBuf,
    dtype: DType,
    device: String,
}

struct Entry {
    model: Transformer,
    users: BTreeSet<String>,
}

#[derive(Default)]
pub struct BaseModels {
    entries: Mutex<HashMap<BaseKey, Entry>>,
}

impl BaseModels {
    /// The base for model `user`, loaded on first use.
    pub fn acquire(&self, user: &str, dir: &Path, dtype: DType, device: &Device) -> Result<Transformer> {
        let key = BaseKey { dir: dir.to_path_buf(), dtype, device: format!("{:?}", device.location()) };
        let mut entries = lock(&self.entries);
        if !entries.contains_key(&key) {
            let model = Transformer::load(dir, dtype, device)?;
            entries.insert(key.clone(), Entry { model, users: BTreeSet::new() });
        }
        let entry = entries.get_mut(&key).expect("just inserted");
        entry.users.insert(user.to_string());
        Ok(entry.model.clone())
    }

    /// Model `user` no longer uses its base; a base nobody uses is dropped.
    pub fn release(&self, user: &str) {
        let mut entries = lock(&self.entries);
        entries.retain(|_, e| {
            e.users.remove(user);
            !e.users.is_empty()
        });
    }

    /// Bases held now.
    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
