//! What the server records of a sample taken with `record_stability_info = true`, for
//! `stable_reinforce` (see [`provenance`](super::provenance)): per sequence id, its prompt,
//! sampled tokens and the sampler's log-probs, owned by the API key (and session) that sampled.
//!
//! As Tinker documents: a record can be trained on for a day after sampling, and each training
//! request that uses it restarts that day. Records live in memory (a restart forgets them: the
//! client samples again), bounded per API key by `Limits::max_recorded_tokens_per_key`; past
//! the bound the key's oldest records go first. Simplification: eviction follows sampling order,
//! not last use.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use super::errors::{ApiError, ApiResult};
use super::provenance::Source;
use crate::locks::lock;

/// How long a record lives after its sampling or its last use.
pub const RECORD_TTL_S: f64 = 86_400.0;

/// One recorded sequence.
#[derive(Clone, Debug)]
pub struct Record {
    pub prompt: Arc<Vec<u32>>,
    pub sampled: Vec<u32>,
    pub logprobs: Vec<f32>,
    key: Option<String>,
    /// The sampling session's session, when the sampler belongs to one.
    session: Option<String>,
    expires: f64,
}

impl Record {
    pub fn tokens(&self, source: Source) -> &[u32] {
        match source {
            Source::Prompt => &self.prompt,
            Source::Sampled => &self.sampled,
        }
    }

    fn size(&self) -> usize {
        self.prompt.len() + self.sampled.len()
    }
}

#[derive(Default)]
struct Inner {
    records: HashMap<String, Record>,
    /// Each key's record ids in sampling order, and the tokens they hold.
    by_key: HashMap<Option<String>, (VecDeque<String>, usize)>,
}

pub struct StabilityRecords {
    inner: Mutex<Inner>,
    budget_per_key: usize,
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl StabilityRecords {
    /// Records of at most `budget_per_key` tokens (prompt + sampled) per API key.
    pub fn new(budget_per_key: usize) -> Self {
        StabilityRecords { inner: Mutex::default(), budget_per_key }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// Records sequence `id` (sampled by `key`, in `session` if the sampler has one).
    pub fn record(
        &self,
        key: Option<&str>,
        session: Option<&str>,
        id: String,
        prompt: Arc<Vec<u32>>,
        sampled: Vec<u32>,
        logprobs: Vec<f32>,
    ) {
        let record = Record {
            prompt,
            sampled,
            logprobs,
            key: key.map(String::from),
            session: session.map(String::from),
            expires: now() + RECORD_TTL_S,
        };
        let size = record.size();
        let mut g = self.lock();
        let Inner { records, by_key } = &mut *g;
        let (ids, tokens) = by_key.entry(record.key.clone()).or_default();
        while *tokens + size > self.budget_per_key {
            let Some(old) = ids.pop_front() else { break };
            if let Some(r) = records.remove(&old) {
                *tokens -= r.size();
            }
        }
        ids.push_back(id.clone());
        *tokens += size;
        if let Some(r) = records.insert(id, record) {
            *tokens -= r.size(); // the same id sampled again (a retried submission)
        }
    }

    /// Sequence `id` for a training request of `key` in `session`, its day restarted; an error
    /// names why it cannot be used (another key's is "unknown", as for models).
    pub fn get(&self, key: Option<&str>, session: &str, id: &str) -> ApiResult<Record> {
        let t = now();
        let mut g = self.lock();
        let r = g.records.get_mut(id).filter(|r| r.key.as_deref() == key && r.expires > t).ok_or_else(|| {
            ApiError::user(format!(
                "sequence `{id}` is unknown: it was not sampled with record_stability_info=True by this API key, \
                 or its record expired (a day after its last use) or was evicted"
            ))
        })?;
        if r.session.as_deref().is_some_and(|s| s != session) {
            return Err(ApiError::user(format!(
                "sequence `{id}` was sampled in another session: a training request can only name sequences \
                 sampled in its own session"
            )));
        }
        r.expires = t + RECORD_TTL_S;
        Ok(r.clone())
    }

    /// Forgets the records whose day is over.
    pub fn sweep(&self) {
        let t = now();
        let mut g = self.lock();
        let Inner { records, by_key } = &mut *g;
        records.retain(|_, r| r.expires > t);
        for (ids, tokens) in by_key.values_mut() {
            ids.retain(|id| records.contains_key(id));
            *tokens = ids.iter().filter_map(|id| records.get(id)).map(Record::size).sum();
        }
        by_key.retain(|_, (ids, _)| !ids.is_empty());
    }

    /// Records held (all keys).
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(r: &StabilityRecords, key: &str, id: &str, n: usize) {
        r.record(Some(key), Some("s"), id.into(), Arc::new(vec![1; n]), vec![2; n], vec![-0.5; n]);
    }

    /// Each key's budget evicts only that key's oldest records; another key's and another
    /// session's requests cannot use a record.
    #[test]
    fn budgets_are_per_key_and_records_are_private() {
        let r = StabilityRecords::new(10);
        rec(&r, "a", "a1", 2); // 4 tokens
        rec(&r, "b", "b1", 4); // 8 tokens
        rec(&r, "a", "a2", 2);
        rec(&r, "a", "a3", 2); // 12 > 10: a1 goes
        assert!(r.get(Some("a"), "s", "a1").is_err());
        assert_eq!(r.get(Some("a"), "s", "a3").unwrap().sampled, vec![2, 2]);
        assert!(r.get(Some("b"), "s", "b1").is_ok(), "another key's record was evicted");
        assert!(r.get(Some("b"), "s", "a2").unwrap_err().message.contains("unknown"));
        assert!(r.get(Some("a"), "t", "a2").unwrap_err().message.contains("another session"));
        assert_eq!(r.len(), 3);
        r.sweep();
        assert_eq!(r.len(), 3, "nothing has expired");
    }
}
