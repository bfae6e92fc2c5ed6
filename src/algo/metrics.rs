//! Scalar metrics that merge exactly across micro-batches, calls and data-parallel ranks.
//!
//! Keys are `name:reduction` (docs/architecture.md), with reduction `sum`, `mean`, `max` or `min`. Every
//! metric is kept as a pair `(sum, count)`: merging two `Metrics` adds sums and counts key by
//! key, so the mean of a whole mini-batch is `Σ sums / Σ counts` however it was split — not the
//! mean of per-micro-batch means. For a `:sum` metric the count is the number of contributions
//! and is ignored by [`Metrics::reduce`]; for `:max` / `:min` the "sum" holds the extreme so far
//! and merging takes the max / min. A `:mean` with count 0 reduces to 0 (JSON has no NaN).
//!
//! Losses compute their metric sums as 0-d tensors and copy them to the host in one transfer
//! ([`PendingMetrics`]), so a loss costs one device→host synchronisation, not one per metric.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::Result;

/// One metric before reduction: the sum of its samples and how many there were.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricValue {
    pub sum: f64,
    pub count: f64,
}

/// Metrics by key `name:reduction`, ordered by key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    entries: BTreeMap<String, MetricValue>,
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `value` to the metric `name:sum`.
    pub fn add_sum(&mut self, name: &str, value: f64) {
        self.add(format!("{name}:sum"), MetricValue { sum: value, count: 1.0 });
    }

    /// Adds `count` samples whose total is `sum` to the metric `name:mean`.
    pub fn add_mean(&mut self, name: &str, sum: f64, count: f64) {
        self.add(format!("{name}:mean"), MetricValue { sum, count });
    }

    /// Adds `value` to the metric `name:max` (the largest value wins).
    pub fn add_max(&mut self, name: &str, value: f64) {
        self.add(format!("{name}:max"), MetricValue { sum: value, count: 1.0 });
    }

    /// Adds `value` to the metric `name:min` (the smallest value wins).
    pub fn add_min(&mut self, name: &str, value: f64) {
        self.add(format!("{name}:min"), MetricValue { sum: value, count: 1.0 });
    }

    /// Adds a `(sum, count)` pair under a full key `name:reduction`.
    pub fn add(&mut self, key: String, value: MetricValue) {
        let extreme = if key.ends_with(":max") {
            Some(f64::max as fn(f64, f64) -> f64)
        } else if key.ends_with(":min") {
            Some(f64::min as fn(f64, f64) -> f64)
        } else {
            None
        };
        match self.entries.get_mut(&key) {
            None => {
                self.entries.insert(key, value);
            }
            Some(entry) => {
                entry.sum = match extreme {
                    Some(pick) => pick(entry.sum, value.sum),
                    None => entry.sum + value.sum,
                };
                entry.count += value.count;
            }
        }
    }

    /// Adds every metric of `other` into `self` (sums and counts add).
    pub fn merge(&mut self, other: &Metrics) {
        for (key, value) in &other.entries {
            self.add(key.clone(), *value);
        }
    }

    pub fn get(&self, key: &str) -> Option<MetricValue> {
        self.entries.get(key).copied()
    }

    /// The reduced value of one key: the sum for `:sum`, sum / count for `:mean`.
    pub fn value(&self, key: &str) -> Option<f64> {
        self.entries.get(key).map(|v| reduce_one(key, *v))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, MetricValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), *v))
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every key with its reduced value, as reported to the user.
    pub fn reduce(&self) -> BTreeMap<String, f64> {
        self.entries.iter().map(|(k, v)| (k.clone(), reduce_one(k, *v))).collect()
    }
}

fn reduce_one(key: &str, value: MetricValue) -> f64 {
    if key.ends_with(":mean") {
        if value.count == 0.0 {
            0.0
        } else {
            value.sum / value.count
        }
    } else {
        value.sum
    }
}

/// Metric sums still on the device, copied to the host together by [`PendingMetrics::finish`].
#[derive(Default)]
pub struct PendingMetrics {
    keys: Vec<String>,
    sums: Vec<Tensor>,
    counts: Vec<Tensor>,
}

impl PendingMetrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// `name:sum` with a 0-d tensor value.
    pub fn sum(&mut self, name: &str, sum: &Tensor) -> Result<()> {
        let one = Tensor::ones((), DType::F64, sum.device())?;
        self.push(format!("{name}:sum"), sum, &one)
    }

    /// `name:mean` with 0-d tensors for the sum and the count of samples.
    pub fn mean(&mut self, name: &str, sum: &Tensor, count: &Tensor) -> Result<()> {
        self.push(format!("{name}:mean"), sum, count)
    }

    fn push(&mut self, key: String, sum: &Tensor, count: &Tensor) -> Result<()> {
        self.keys.push(key);
        self.sums.push(sum.detach().to_dtype(DType::F64)?.reshape(())?);
        self.counts.push(count.detach().to_dtype(DType::F64)?.reshape(())?);
        Ok(())
    }

    /// Copies every pending value to the host in one transfer.
    pub fn finish(self) -> Result<Metrics> {
        let mut metrics = Metrics::new();
        if self.keys.is_empty() {
            return Ok(metrics);
        }
        let all: Vec<Tensor> = self.sums.into_iter().chain(self.counts).collect();
        let host = Tensor::stack(&all, 0)?.to_vec1::<f64>()?;
        let n = self.keys.len();
        for (i, key) in self.keys.into_iter().enumerate() {
            metrics.add(key, MetricValue { sum: host[i], count: host[n + i] });
        }
        Ok(metrics)
    }
}
