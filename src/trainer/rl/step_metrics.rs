//! One RL step's line of `metrics.jsonl`, typed as SFT's [`StepMetrics`](crate::trainer::StepMetrics)
//! is: every key written in one place, in the order the line has always had. Non-finite values are
//! written as `null` (serde_json's rule). The plots read the line by these keys
//! ([`crate::trainer::plot::RL_PLOTS`]); a test holds every key they name to this type.

use std::collections::BTreeMap;

use serde::Serialize;

/// The line of one RL step.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RlStepMetrics {
    /// Wall seconds the loop waited for the step's groups (sync: the whole generation; async:
    /// what generation did not overlap with training).
    pub time_generate_s: f64,
    /// Seconds the weight push to the engines took.
    pub time_sync_s: f64,
    /// Episodes generated per second of the step's wall time.
    pub samples_per_s: f64,
    /// The engines' weight version after the step's push (none when nothing was trained).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<u64>,
    /// The asynchronous source's keys (async mode only).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub source: Option<AsyncMetrics>,
    /// Engines that fell (their requests went to the others) or rejoined during the step.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engine_events: Vec<String>,
    /// Optimizer steps taken, 1 for the first.
    pub step: usize,
    #[serde(flatten)]
    pub rollouts: RolloutMetrics,
    /// Mean KL to the reference over trained tokens.
    pub kl_mean: f64,
    /// The KL controller's coefficient used by the step.
    pub kl_coef: f64,
    /// Fraction of trained tokens the policy loss clipped.
    pub clip_fraction: f64,
    /// The policy loss (`loss:sum` of the step's mini-batches).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used by the step.
    pub lr: f64,
    /// Episodes the step trained on.
    pub episodes_trained: usize,
    /// Seconds of the reference (and old-policy, critic) forwards.
    pub time_reference_s: f64,
    /// Seconds of the mini-batches' forward_backward + optim_step.
    pub time_train_s: f64,
    /// Largest |sampler log-prob − trainer log-prob| over the step's sampled tokens.
    pub logprob_mismatch_max: f64,
    /// Sampled tokens whose experts differ between the sampler and the trainer (models with
    /// experts only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_mismatch: Option<u64>,
    /// Evaluation pass@1 and pass@n, on steps that evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_pass_at_1: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_pass_at_n: Option<f64>,
    /// Peak resident set size of the process writing the line, in GB (10⁹ bytes), since it
    /// started ([`crate::memory`]); null where the system does not report it.
    pub peak_rss_gb: f64,
    /// The most GPU memory in use at once since the process opened its GPUs, in GB, summed over
    /// them ([`crate::memory::device_peak_gb`]); absent where it opened none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_device_gb: Option<f64>,
}

/// What the step's generated episodes looked like (every episode generated for it, filtered or
/// not).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RolloutMetrics {
    pub reward_mean: f64,
    pub correct_mean: f64,
    /// Mean sampled tokens per episode.
    pub response_length_mean: f64,
    /// Mean model turns per episode.
    pub turns_mean: f64,
    /// Mean entropy of the sampled tokens' distributions.
    pub entropy_mean: f64,
    pub episodes_generated: usize,
    /// Episodes scored 0 because the user's code failed (`reward.on_error = "zero"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reward_errors: Option<usize>,
    /// Means of what envs logged: `reward/<key>`, `reward/<data_source>/<key>`.
    #[serde(flatten)]
    pub logged: BTreeMap<String, f64>,
}

/// The asynchronous source's part of the line.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AsyncMetrics {
    /// Seconds the trainer waited for finished groups.
    pub time_wait_data_s: f64,
    /// Seconds generation waited for staleness capacity, per generation worker.
    pub time_wait_capacity_s: f64,
    /// Steps between a trained group's generation start and the step that trained it.
    pub staleness_mean: f64,
    pub staleness_max: f64,
    /// Episodes whose tokens were sampled by more than one weight version.
    pub episodes_mixed_versions: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::plot::RL_PLOTS;

    fn line(async_mode: bool) -> serde_json::Map<String, serde_json::Value> {
        let m = RlStepMetrics {
            weight_version: Some(3),
            source: async_mode.then(AsyncMetrics::default),
            engine_events: vec!["engine 1 fell".into()],
            eval_pass_at_1: Some(0.5),
            eval_pass_at_n: Some(1.0),
            ..Default::default()
        };
        match serde_json::to_value(m).unwrap() {
            serde_json::Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    /// The keys and their order as the line was written before it was typed, then `peak_rss_gb`
    /// (a sync step, then an async one, each with an update, an engine event and an evaluation).
    #[test]
    fn the_line_keeps_its_keys_in_their_order() {
        let keys = |m: &serde_json::Map<String, serde_json::Value>| m.keys().cloned().collect::<Vec<_>>().join(",");
        let common =
            "step,reward_mean,correct_mean,response_length_mean,turns_mean,entropy_mean,episodes_generated,kl_mean,\
                      kl_coef,clip_fraction,loss,grad_norm,lr,episodes_trained,time_reference_s,time_train_s,\
                      logprob_mismatch_max,eval_pass_at_1,eval_pass_at_n,peak_rss_gb";
        assert_eq!(
            keys(&line(false)),
            format!("time_generate_s,time_sync_s,samples_per_s,weight_version,engine_events,{common}")
        );
        assert_eq!(
            keys(&line(true)),
            format!(
                "time_generate_s,time_sync_s,samples_per_s,weight_version,time_wait_data_s,time_wait_capacity_s,\
                 staleness_mean,staleness_max,episodes_mixed_versions,engine_events,{common}"
            )
        );
        // Optional keys are absent, not null, when they do not apply; NaN is null.
        let bare = serde_json::to_value(RlStepMetrics { kl_mean: f64::NAN, ..Default::default() }).unwrap();
        for k in ["weight_version", "engine_events", "eval_pass_at_1", "staleness_mean"] {
            assert!(bare.get(k).is_none(), "{k} in {bare}");
        }
        assert!(bare["kl_mean"].is_null(), "{bare}");
    }

    /// Every key a plot reads is one the line writes.
    #[test]
    fn every_plotted_key_is_written() {
        let all = line(true);
        for plot in &RL_PLOTS {
            for (key, _, _) in plot.series {
                assert!(all.contains_key(*key), "{} plots `{key}`, which the RL line never writes", plot.file);
            }
        }
    }
}
