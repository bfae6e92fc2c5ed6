//! Episodes: prompts × n samples through the sampling engines and the environments.
//!
//! ```text
//! for each prompt p (a group of n episodes, one env each):
//!     tokens = chat_template(env.initial(), generation prompt)        # Env segment
//!     loop:                                                           # one model turn
//!         reply = engine(tokens, max_tokens = budget(p))              # Model segment
//!         match env.step(text(reply)):
//!             Done(outcome)        -> the episode ends with its reward
//!             Continue(observation) -> tokens += the template text the observation adds
//!         after env.max_turns turns without Done: the env's turn-limit outcome (Python envs:
//!             truncated), or an error naming the env (a built-in broke its contract)
//! ```
//! Envs are built by the run's [`EnvFactory`] (built-ins, the user's Python reward function or
//! env classes). A step answered elsewhere (Python) is started as soon as its reply is in and
//! waited for after every other reply of the round, so a round's steps run as one batch in the
//! worker pool; a step answered at once (the built-ins) is handled as its reply comes in.
//! A turn's budget is `env.max_turn_tokens`, or the prompt row's own `max_tokens` when that is
//! smaller ([`PromptRow::max_tokens`]: per-prompt budgets, e.g. a long-tail workload).
//! Every prompt's first turn is one request of n samples (they share the prefill); every
//! request of the step is submitted before any is awaited, so the engines batch them all.
//! Sampled tokens are kept exactly as sampled (never re-tokenized): a later turn appends the
//! template's closing of the reply that the model did not generate (e.g. the newline after
//! `<|im_end|>`, or the whole end-of-turn marker after a reply cut at max_tokens) and the
//! rendering of the new messages, found as the difference of two renderings. The loss mask
//! ([`crate::env::build_sequence`]) covers only the sampled tokens.
//!
//! Seeds: each group has its own seed `s` (given, or `hash(seed, i)` for prompt i); its first
//! turn samples j with `s + j` (the engine's rule), later turns of episode j with
//! `hash(s, 1_000_003 · turn + j)`. A group's random draws therefore depend only on its prompt
//! and seed — not on the other prompts of the call, nor on how the engines interleave them — so
//! the asynchronous trainer, which generates one group at a time, samples what the synchronous
//! one does, up to float rounding: a row's logits can differ in their last bits with the rows it
//! shares a decode step with (the matmul kernel and its summation order depend on the batch
//! size, and which requests share a step depends on when they reached the engine), and a draw
//! that lands within that of a boundary between two tokens picks the other one. Rare (two
//! 500-step demo runs with one seed: identical rewards and losses, entropies 1e-8 apart), but two
//! runs are not bit-identical.

use std::collections::BTreeMap;

use crate::env::{
    build_sequence, messages_to_json, Env, EnvFactory, Message, Outcome, PendingStep, PromptRow, Segment, Step,
    TrainingSequence,
};
use crate::handle::Handle;
use crate::model::tokenizer::Tokenizer;
use crate::rollout::{EngineClient, Request, RequestOutput, SamplingParams};
use crate::splitmix;
use crate::{Error, Result};

/// Where episodes get their model turns: the engine client, or a script in tests.
pub trait TurnSampler {
    fn submit(&self, req: Request) -> Handle<RequestOutput>;
}

impl TurnSampler for EngineClient {
    fn submit(&self, req: Request) -> Handle<RequestOutput> {
        EngineClient::submit(self, req)
    }
}

/// One finished episode.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Episode {
    /// Index of its prompt in the step's batch (episodes of one prompt form a group).
    pub group: usize,
    pub uid: String,
    /// Input/target tokens, the loss mask over sampled tokens and their sampler log-probs.
    pub sequence: TrainingSequence,
    pub reward: f64,
    /// The env's verdict without format rewards (eval accuracy).
    pub correct: bool,
    pub truncated: bool,
    pub turns: usize,
    /// Sampled tokens over all turns.
    pub response_tokens: usize,
    /// The lowest weight version among its sampled tokens.
    pub min_version: u64,
    /// The weight version that sampled each sampled token, in order over the turns (an update
    /// in flight changes it mid-sequence).
    pub versions: Vec<u64>,
    /// The row's `data_source` (verl's datasets), for per-source reward metrics.
    #[serde(default)]
    pub data_source: Option<String>,
    /// Numbers the env logged (a reward function's extra keys), averaged per step in metrics.
    #[serde(default)]
    pub reward_metrics: BTreeMap<String, f64>,
    /// The user's code failed and `reward.on_error = "zero"` scored the episode 0.
    #[serde(default)]
    pub user_error: bool,
}

/// An episode in progress.
struct Running {
    group: usize,
    uid: String,
    data_source: Option<String>,
    env: Box<dyn Env>,
    messages: Vec<Message>,
    segments: Vec<Segment>,
    /// The full token sequence so far (the next request's prompt).
    tokens: Vec<u32>,
    turns: usize,
    versions: Vec<u64>,
}

/// A 64-bit mix of the step seed and a prompt index: output `index` of the SplitMix64 stream
/// that starts at state `seed` (the first output of state `seed + index·GOLDEN`).
pub fn prompt_seed(seed: u64, index: usize) -> u64 {
    let mut state = seed.wrapping_add((index as u64).wrapping_mul(splitmix::GOLDEN));
    splitmix::next(&mut state)
}

fn render(tok: &Tokenizer, messages: &[Message], generation_prompt: bool) -> Result<String> {
    tok.apply_chat_template(&messages_to_json(messages), generation_prompt, None)
}

/// Runs `n` episodes of every prompt (prompt i seeded with `hash(seed, i)`); episodes come
/// back grouped, prompt by prompt.
pub fn generate_episodes(
    client: &dyn TurnSampler,
    tok: &Tokenizer,
    prompts: &[PromptRow],
    envs: &EnvFactory,
    params: &SamplingParams,
    n: usize,
    seed: u64,
) -> Result<Vec<Episode>> {
    let seeds: Vec<u64> = (0..prompts.len()).map(|i| prompt_seed(seed, i)).collect();
    generate_groups(client, tok, prompts, &seeds, envs, params, n)
}

/// Runs `n` episodes of every prompt, prompt i's group seeded with `seeds[i]`; episodes come
/// back grouped, prompt by prompt.
pub fn generate_groups(
    client: &dyn TurnSampler,
    tok: &Tokenizer,
    prompts: &[PromptRow],
    seeds: &[u64],
    envs: &EnvFactory,
    params: &SamplingParams,
    n: usize,
) -> Result<Vec<Episode>> {
    if seeds.len() != prompts.len() {
        return Err(Error::Other(format!("{} group seeds for {} prompts", seeds.len(), prompts.len())));
    }
    let max_turn_tokens = envs.config.max_turn_tokens;
    // Each prompt's per-turn budget: the env's, capped by the row's own `max_tokens`.
    let budgets: Vec<usize> =
        prompts.iter().map(|p| p.max_tokens().map_or(max_turn_tokens, |m| m.min(max_turn_tokens))).collect();
    // First turns: one request of n samples per prompt.
    let mut running: Vec<Running> = vec![];
    let mut first: Vec<Handle<RequestOutput>> = vec![];
    for (i, p) in prompts.iter().enumerate() {
        let envs = (0..n).map(|_| envs.make(p)).collect::<Result<Vec<_>>>()?;
        let messages = envs.first().map(|e| e.initial()).unwrap_or_default();
        let prompt = tok.encode(&render(tok, &messages, true)?, false)?;
        let stop_strings = envs.first().map(|e| e.stop_strings()).unwrap_or_default();
        let request_params =
            SamplingParams { max_tokens: budgets[i], seed: Some(seeds[i]), stop_strings, ..params.clone() };
        first.push(client.submit(Request {
            num_samples: n,
            route_key: Some(i as u64),
            ..Request::new(prompt.clone(), request_params)
        }));
        let data_source = p.row.get("data_source").and_then(|v| v.as_str()).map(str::to_string);
        for env in envs {
            running.push(Running {
                group: i,
                uid: p.uid.clone(),
                data_source: data_source.clone(),
                env,
                messages: messages.clone(),
                segments: vec![Segment::env(prompt.clone())],
                tokens: prompt.clone(),
                turns: 0,
                versions: vec![],
            });
        }
    }
    let mut replies: Vec<Option<Handle<RequestOutput>>> = vec![];
    for h in first {
        let out = h.wait()?;
        if out.samples.len() != n {
            return Err(Error::Other(format!("the engine returned {} samples for {n}", out.samples.len())));
        }
        for g in out.samples {
            replies.push(Some(Handle::ready(Ok(RequestOutput {
                samples: vec![g],
                prompt_logprobs: None,
                prompt_topk: None,
            }))));
        }
    }

    let turns = Turns { client, tok, prompts, seeds, budgets: &budgets, params, n };
    let mut done: Vec<Option<Episode>> = (0..running.len()).map(|_| None).collect();
    let mut round = 0usize;
    loop {
        let mut next: Vec<Option<Handle<RequestOutput>>> = (0..running.len()).map(|_| None).collect();
        let mut waiting: Vec<(usize, Turn, PendingStep)> = vec![];
        for (k, reply) in replies.iter_mut().enumerate() {
            let Some(h) = reply.take() else { continue };
            let g = h.wait()?.samples.into_iter().next().ok_or_else(|| Error::Other("empty engine reply".into()))?;
            let ep = &mut running[k];
            let turn = Turn { text: tok.decode(&g.tokens, true)?, sampled: g.tokens.clone() };
            ep.turns += 1;
            ep.versions.extend(&g.versions);
            ep.tokens.extend(&g.tokens);
            ep.segments.push(Segment::model(g.tokens, g.logprobs));
            let pending = ep.env.start_step(&turn.text);
            if pending.is_ready() {
                next[k] = turns.advance(ep, k, round, turn, pending.wait()?, &mut done[k])?;
            } else {
                waiting.push((k, turn, pending));
            }
        }
        for (k, turn, pending) in waiting {
            next[k] = turns.advance(&mut running[k], k, round, turn, pending.wait()?, &mut done[k])?;
        }
        if next.iter().all(Option::is_none) {
            break;
        }
        replies = next;
        round += 1;
    }
    done.into_iter()
        .enumerate()
        .map(|(k, e)| e.ok_or_else(|| Error::Other(format!("episode {k} did not finish"))))
        .collect()
}

/// One sampled model turn: its text and tokens.
struct Turn {
    text: String,
    sampled: Vec<u32>,
}

/// What the episodes of one call share for their later turns.
struct Turns<'a> {
    client: &'a dyn TurnSampler,
    tok: &'a Tokenizer,
    prompts: &'a [PromptRow],
    seeds: &'a [u64],
    budgets: &'a [usize],
    params: &'a SamplingParams,
    n: usize,
}

impl Turns<'_> {
    /// Takes the env's answer to episode `k`'s turn: the finished episode into `done`, or the
    /// next turn submitted (returned).
    fn advance(
        &self,
        ep: &mut Running,
        k: usize,
        round: usize,
        turn: Turn,
        step: Step,
        done: &mut Option<Episode>,
    ) -> Result<Option<Handle<RequestOutput>>> {
        let step = match step {
            Step::Continue { .. } if ep.turns >= ep.env.max_turns() => Step::Done(self.at_turn_limit(ep)?),
            step => step,
        };
        match step {
            Step::Done(outcome) => {
                *done = Some(finished(ep, outcome)?);
                Ok(None)
            }
            Step::Continue { observation } => {
                let added = continuation_tokens(self.tok, &ep.messages, &turn.text, &turn.sampled, &observation)?;
                ep.messages.push(Message::assistant(turn.text));
                ep.messages.extend(observation);
                ep.tokens.extend(&added);
                ep.segments.push(Segment::env(added));
                let turn_seed = prompt_seed(self.seeds[ep.group], 1_000_003 * (round + 1) + k % self.n);
                let request_params = SamplingParams {
                    max_tokens: self.budgets[ep.group],
                    seed: Some(turn_seed),
                    stop_strings: ep.env.stop_strings(),
                    ..self.params.clone()
                };
                Ok(Some(self.client.submit(Request::new(ep.tokens.clone(), request_params))))
            }
        }
    }

    /// The outcome of an episode still going at its env's turn limit.
    fn at_turn_limit(&self, ep: &mut Running) -> Result<Outcome> {
        ep.env.at_turn_limit().ok_or_else(|| {
            let p = &self.prompts[ep.group];
            Error::Other(format!(
                "env `{}` is not done after its max_turns ({}) model turns on row {}: an env must end its episodes",
                p.env,
                ep.env.max_turns(),
                p.source
            ))
        })
    }
}

/// A finished episode.
fn finished(ep: &mut Running, outcome: Outcome) -> Result<Episode> {
    let sequence = build_sequence(&ep.segments)?;
    Ok(Episode {
        group: ep.group,
        uid: ep.uid.clone(),
        response_tokens: sequence.num_model_tokens(),
        sequence,
        reward: outcome.reward,
        correct: outcome.correct,
        truncated: outcome.truncated,
        turns: ep.turns,
        min_version: ep.versions.iter().copied().min().unwrap_or(0),
        versions: std::mem::take(&mut ep.versions),
        data_source: ep.data_source.clone(),
        reward_metrics: outcome.metrics,
        user_error: outcome.user_error.is_some(),
    })
}

/// The tokens that follow a sampled reply before the model's next turn: the template's closing
/// of the reply that was not sampled, then the observation's messages and the generation
/// prompt — all as the chat template renders them after `history` + the reply.
fn continuation_tokens(
    tok: &Tokenizer,
    history: &[Message],
    reply_text: &str,
    reply_tokens: &[u32],
    observation: &[Message],
) -> Result<Vec<u32>> {
    let prompt = render(tok, history, true)?;
    let mut with_reply = history.to_vec();
    with_reply.push(Message::assistant(reply_text));
    let closed = render(tok, &with_reply, false)?;
    let mut with_obs = with_reply.clone();
    with_obs.extend_from_slice(observation);
    let next = render(tok, &with_obs, true)?;
    let template_error = |what: &str| {
        Error::input(format!(
            "multi-turn rollout: the chat template does not render conversations as prefixes of each other ({what})"
        ))
    };
    let rendered_reply = closed.strip_prefix(&prompt).ok_or_else(|| template_error("prompt vs reply"))?;
    let added = next.strip_prefix(&closed).ok_or_else(|| template_error("reply vs observation"))?;
    // What the model produced, special tokens included (an end-of-turn token it sampled).
    let sampled = tok.decode(reply_tokens, false)?;
    let closing = match rendered_reply.strip_prefix(sampled.as_str()) {
        Some(rest) => rest.to_string(),
        // The sample's text differs from its rendering (e.g. the template trims it): close
        // after the reply's plain text.
        None => rendered_reply.strip_prefix(reply_text).map(str::to_string).unwrap_or_default(),
    };
    tok.encode(&format!("{closing}{added}"), false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_seeds_are_pinned() {
        // Computed before `prompt_seed` moved onto `crate::splitmix`: a run's sampling seeds
        // must not change with it.
        assert_eq!(prompt_seed(0, 0), 0xe220a8397b1dcdaf);
        assert_eq!(prompt_seed(0, 1), 0x6e789e6aa1b965f4);
        assert_eq!(prompt_seed(0, 2), 0x06c45d188009454f);
        assert_eq!(prompt_seed(7, 0), 0x63cbe1e459320dd7);
        assert_eq!(prompt_seed(7, 5), 0x3fdabe86cbbeaa11);
        assert_eq!(prompt_seed(42, 1_000_003), 0xc0fd206e762d2420);
        assert_eq!(prompt_seed(u64::MAX, 3), 0x6d1db36ccba982d2);
    }
}
