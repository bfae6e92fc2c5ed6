//! What one request or one API key may ask of `oxrl serve`: every size that multiplies into
//! memory is bounded here, in one place, and a request past a limit is refused with a 400 that
//! names the limit and its `oxrl serve` flag — never by the process dying or starving.

use super::errors::{ApiError, ApiResult};

#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest LoRA rank of a training model (`--max-lora-rank`). Default 128.
    pub max_lora_rank: usize,
    /// Tokens (all datums together) in one forward / forward_backward (`--max-train-tokens`).
    /// Default 65,536.
    pub max_train_tokens: usize,
    /// Samples in one sampling request (`--max-samples`). Default 64 (a sampler's batch).
    pub max_samples: usize,
    /// Values one sampling result may hold: samples × (max_tokens) × (1 + sample top-k) +
    /// prompt × (1 + prompt top-k) (`--max-sample-values`). Default 4,194,304 (~50 MB stored).
    pub max_sample_values: usize,
    /// Bytes of `user_metadata` (as JSON) of a session or model (`--max-metadata-bytes`).
    /// Default 65,536.
    pub max_metadata_bytes: usize,
    /// Training models alive per API key (`--max-models-per-key`). Default 32.
    pub max_models_per_key: usize,
    /// Sampling sessions alive per API key (`--max-samplers-per-key`). Default 64.
    pub max_samplers_per_key: usize,
    /// Connections open at once (`--max-connections`); past it, connections answer `healthz`
    /// and `readyz` only (see [`super::connections`]). Default 512.
    pub max_connections: usize,
    /// Connections open at once from one peer address (`--max-connections-per-peer`); more are
    /// answered `429` and closed. Default 128.
    pub max_connections_per_peer: usize,
    /// Seconds a client has to send a request's headers, from the first byte it waits for
    /// (`--header-timeout-s`); also how long an idle keep-alive connection stays open. Default 10.
    pub header_timeout_s: u64,
    /// Seconds a connection may send nothing while the server waits to read from it (a body
    /// midway; `--idle-timeout-s`; more than the 30 s long poll). Default 60.
    pub idle_timeout_s: u64,
    /// Seconds a finished request's result is kept for `retrieve_future`
    /// (`--result-retention-s`); then it is deleted, so the database does not only grow.
    /// Default 86,400 (a day).
    pub result_retention_s: u64,
    /// Tokens (prompt + sampled) of the samples recorded for `stable_reinforce` per API key
    /// (`--max-recorded-tokens-per-key`); past it the key's oldest records are forgotten.
    /// Default 16,777,216 (~200 MB with their log-probs).
    pub max_recorded_tokens_per_key: usize,
    /// Tokens of forward / forward_backward requests accepted and not yet done, per training
    /// model (`--max-tokens-in-flight`); 0: derived per base model from the machine — half the
    /// memory available at start over the model's bytes per token (`ServedModel::bytes_per_token`),
    /// at least `max_train_tokens`.
    pub max_tokens_in_flight: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_lora_rank: 128,
            max_train_tokens: 65_536,
            max_samples: 64,
            max_sample_values: 1 << 22,
            max_metadata_bytes: 65_536,
            max_models_per_key: 32,
            max_samplers_per_key: 64,
            max_connections: 512,
            max_connections_per_peer: 128,
            header_timeout_s: 10,
            idle_timeout_s: 60,
            result_retention_s: 86_400,
            max_recorded_tokens_per_key: 1 << 24,
            max_tokens_in_flight: 0,
        }
    }
}

/// The error for `what` = `value` past the limit `max` set by `flag`.
fn over(what: &str, value: impl std::fmt::Display, max: usize, flag: &str) -> ApiError {
    ApiError::user(format!("{what} is {value}, over this server's limit of {max} (oxrl serve {flag})"))
}

/// Bytes of memory available to new work on this machine (`MemAvailable`), if known.
pub fn memory_available() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl Limits {
    /// The tokens in flight a model over a base of `bytes_per_token` may hold, with
    /// `available` bytes of memory on the machine (see [`Limits::max_tokens_in_flight`]).
    pub fn tokens_in_flight_budget(&self, bytes_per_token: usize, available: Option<usize>) -> usize {
        if self.max_tokens_in_flight > 0 {
            return self.max_tokens_in_flight;
        }
        let derived = available.map_or(usize::MAX, |a| a / 2 / bytes_per_token.max(1));
        derived.max(self.max_train_tokens)
    }

    pub fn lora_rank(&self, rank: usize) -> ApiResult<()> {
        if rank > self.max_lora_rank {
            return Err(over("lora_config.rank", rank, self.max_lora_rank, "--max-lora-rank"));
        }
        Ok(())
    }

    /// `tokens`: the request's datums' lengths added up.
    pub fn train_tokens(&self, tokens: usize) -> ApiResult<()> {
        if tokens > self.max_train_tokens {
            return Err(over("the tokens of this request", tokens, self.max_train_tokens, "--max-train-tokens"));
        }
        Ok(())
    }

    /// A sampling request: `samples` of at most `max_tokens` each after a prompt of `prompt`
    /// tokens, with top-k lists of `topk` = (prompt, sample) entries.
    pub fn sample(&self, samples: usize, max_tokens: usize, prompt: usize, topk: (usize, usize)) -> ApiResult<()> {
        if samples == 0 || samples > self.max_samples {
            return Err(over("num_samples", samples, self.max_samples, "--max-samples"));
        }
        let values = samples
            .saturating_mul(max_tokens)
            .saturating_mul(1 + topk.1)
            .saturating_add(prompt.saturating_mul(1 + topk.0));
        if values > self.max_sample_values {
            return Err(over(
                "num_samples × max_tokens × (1 + topk_sample_logprobs) + prompt × (1 + topk_prompt_logprobs)",
                values,
                self.max_sample_values,
                "--max-sample-values",
            ));
        }
        Ok(())
    }

    /// `json`: the metadata as the client sent it.
    pub fn metadata(&self, json: &str) -> ApiResult<()> {
        if json.len() > self.max_metadata_bytes {
            return Err(over("user_metadata (bytes)", json.len(), self.max_metadata_bytes, "--max-metadata-bytes"));
        }
        Ok(())
    }

    /// `alive`: the caller's sampling sessions alive now.
    pub fn samplers_per_key(&self, alive: usize) -> ApiResult<()> {
        per_key(alive, self.max_samplers_per_key, "sampling sessions", "--max-samplers-per-key")
    }

    /// `alive`: the caller's training models alive now.
    pub fn models_per_key(&self, alive: usize) -> ApiResult<()> {
        per_key(alive, self.max_models_per_key, "training models", "--max-models-per-key")
    }
}

/// One more of `what` for a key that has `alive` of them, at most `max`.
fn per_key(alive: usize, max: usize, what: &str, flag: &str) -> ApiResult<()> {
    if alive >= max {
        return Err(ApiError::user(format!(
            "this API key has {alive} {what} alive, this server's limit (oxrl serve {flag} {max}): end a \
             session to free them"
        )));
    }
    Ok(())
}
