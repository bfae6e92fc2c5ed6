//! Datum provenance (`Datum` fields 3 and 4) and what `stable_reinforce` reads from it.
//!
//! A datum may say where its tokens came from: `model_input_spans` tile its input tokens and
//! `loss_fn_input_spans` tile its `target_tokens`, each run naming a sampled sequence
//! (`SampledSequence.sequence_id`) and a range of that sequence's prompt or sampled tokens.
//! Every loss accepts provenance (the cookbook attaches it to every RL datum) and checks its
//! tiling; only `stable_reinforce` reads it:
//!
//! ```text
//! for each run of the model input:   the tokens must be the recorded ones
//! for each run of the loss inputs:   sampled: targets = the recorded tokens; q = the recorded
//!                                             sampler log-probs; weight 1 (× the client's)
//!                                    prompt:  weight 0, and the advantage there must be 0
//! ```
//! so the loss's `q` is what the server itself recorded when it sampled
//! ([`StabilityRecords`]), never a client's copy. Targets under a prompt run are not checked
//! (the cookbook sends 0 there).

use super::errors::{ApiError, ApiResult};
use super::proto;
use super::stability_records::StabilityRecords;
use crate::worker::Datum;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Prompt,
    Sampled,
}

/// One run: `length` positions that are `[offset, offset + length)` of the named sequence's
/// prompt or sampled tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub source: Source,
    pub sequence_id: String,
    pub offset: usize,
    pub length: usize,
}

/// A datum's two tilings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Provenance {
    pub model_input: Vec<Span>,
    pub loss_inputs: Vec<Span>,
}

/// Datum `i`'s provenance, checked to tile its `n_input` input tokens and `n_targets` targets;
/// `None` when it has none.
pub fn from_proto(i: usize, d: &proto::Datum, n_input: usize, n_targets: usize) -> ApiResult<Option<Provenance>> {
    if d.model_input_spans.is_empty() && d.loss_fn_input_spans.is_empty() {
        return Ok(None);
    }
    if d.model_input_spans.is_empty() != d.loss_fn_input_spans.is_empty() {
        return Err(ApiError::user(format!(
            "datum {i}: provenance comes as a pair: model_input_spans and loss_fn_input_spans, both or neither"
        )));
    }
    let model_input = runs(i, "model_input_spans", &d.model_input_spans, n_input, "model_input tokens")?;
    let loss_inputs = runs(i, "loss_fn_input_spans", &d.loss_fn_input_spans, n_targets, "target_tokens")?;
    Ok(Some(Provenance { model_input, loss_inputs }))
}

fn runs(i: usize, field: &str, spans: &[proto::ProvenanceSpan], n: usize, tiled: &str) -> ApiResult<Vec<Span>> {
    let bad = |why: String| ApiError::user(format!("datum {i}: {field}: {why}"));
    let mut out = Vec::with_capacity(spans.len());
    let mut covered = 0usize;
    for (j, s) in spans.iter().enumerate() {
        let (source, run) = match &s.span {
            Some(proto::provenance_span::Span::PromptTokens(r)) => (Source::Prompt, r),
            Some(proto::provenance_span::Span::SampledTokens(r)) => (Source::Sampled, r),
            None => return Err(bad(format!("run {j} is neither prompt_tokens nor sampled_tokens"))),
        };
        if run.sequence_id.is_empty() {
            return Err(bad(format!("run {j} has no sequence_id")));
        }
        let (Ok(offset), Ok(length)) = (usize::try_from(run.offset), usize::try_from(run.length)) else {
            return Err(bad(format!("run {j}: offset {} and length {} must be ≥ 0", run.offset, run.length)));
        };
        covered = covered
            .checked_add(length)
            .filter(|&c| c <= n)
            .ok_or_else(|| bad(format!("the runs cover more than the {n} {tiled}")))?;
        out.push(Span { source, sequence_id: run.sequence_id.clone(), offset, length });
    }
    if covered != n {
        return Err(bad(format!("the runs cover {covered} positions, not the {n} {tiled}")));
    }
    Ok(out)
}

/// `stable_reinforce`: checks every datum's provenance against the caller's records (API key
/// `key`, training in session `session`) and fills its `logprobs` (the recorded sampler
/// log-probs) and `weights` (1 on sampled positions, times the client's; 0 on prompt ones).
pub fn resolve(
    records: &StabilityRecords,
    key: Option<&str>,
    session: &str,
    data: &mut [Datum],
    provenance: &[Option<Provenance>],
) -> ApiResult<()> {
    for (i, datum) in data.iter_mut().enumerate() {
        let p = provenance.get(i).and_then(Option::as_ref).ok_or_else(|| {
            ApiError::user(format!(
                "datum {i}: stable_reinforce needs provenance: sample with record_stability_info=True and \
                 attach the sequences' spans (Datum.with_provenance)"
            ))
        })?;
        let bad = |why: String| ApiError::user(format!("datum {i}: {why}"));
        let mut at = 0;
        for span in &p.model_input {
            let rec = records.get(key, session, &span.sequence_id)?;
            let recorded = slice(rec.tokens(span.source), span).ok_or_else(|| bad(out_of_range(span)))?;
            if datum.input_tokens[at..at + span.length] != *recorded {
                return Err(bad(format!(
                    "model_input positions {at}..{} are not the recorded tokens of sequence {}",
                    at + span.length,
                    span.sequence_id
                )));
            }
            at += span.length;
        }
        let inputs = &mut datum.loss_fn_inputs;
        let n = inputs.target_tokens.as_ref().map_or(0, Vec::len);
        let advantages =
            inputs.advantages.as_deref().ok_or_else(|| bad("stable_reinforce needs `advantages`".into()))?;
        let mut q = vec![0f32; n];
        let mut w = vec![0f32; n];
        let mut at = 0;
        for span in &p.loss_inputs {
            let rec = records.get(key, session, &span.sequence_id)?;
            let range = at..at + span.length;
            match span.source {
                Source::Prompt => {
                    slice(&rec.prompt, span).ok_or_else(|| bad(out_of_range(span)))?;
                    if let Some(t) = range.clone().find(|&t| advantages.get(t).is_some_and(|&a| a != 0.0)) {
                        return Err(bad(format!(
                            "advantage {} at target {t}, a prompt position: stable_reinforce takes advantages on \
                             sampled tokens only",
                            advantages[t]
                        )));
                    }
                }
                Source::Sampled => {
                    let tokens = slice(&rec.sampled, span).ok_or_else(|| bad(out_of_range(span)))?;
                    let targets = inputs.target_tokens.as_deref().unwrap_or_default();
                    if targets[range.clone()] != *tokens {
                        return Err(bad(format!(
                            "target_tokens {}..{} are not the sampled tokens of sequence {}",
                            range.start, range.end, span.sequence_id
                        )));
                    }
                    q[range.clone()].copy_from_slice(&rec.logprobs[span.offset..span.offset + span.length]);
                    w[range.clone()].fill(1.0);
                }
            }
            at = range.end;
        }
        if let Some(client) = &inputs.weights {
            w.iter_mut().zip(client).for_each(|(w, c)| *w *= c);
        }
        inputs.logprobs = Some(q);
        inputs.weights = Some(w);
    }
    Ok(())
}

/// The recorded tokens a run names, if the sequence has them.
fn slice<'a>(tokens: &'a [u32], span: &Span) -> Option<&'a [u32]> {
    tokens.get(span.offset..span.offset.checked_add(span.length)?)
}

fn out_of_range(span: &Span) -> String {
    let what = if span.source == Source::Prompt { "prompt" } else { "sampled tokens" };
    format!(
        "a run names positions {}..{} of sequence {}'s {what}, which it does not have",
        span.offset,
        span.offset.saturating_add(span.length),
        span.sequence_id
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::worker::LossFnInputs;

    fn run(source: Source, id: &str, offset: i64, length: i64) -> proto::ProvenanceSpan {
        let run = proto::SpanRun { sequence_id: id.into(), offset, length };
        let span = match source {
            Source::Prompt => proto::provenance_span::Span::PromptTokens(run),
            Source::Sampled => proto::provenance_span::Span::SampledTokens(run),
        };
        proto::ProvenanceSpan { span: Some(span) }
    }

    /// rl_loop.py's shape: prompt [1, 2, 3], sampled [4, 5]; input = prompt + sampled[..1],
    /// targets = [0, 0] + sampled.
    fn cookbook_datum(model: Vec<proto::ProvenanceSpan>, loss: Vec<proto::ProvenanceSpan>) -> proto::Datum {
        proto::Datum { model_input_spans: model, loss_fn_input_spans: loss, ..Default::default() }
    }

    fn spans(id: &str) -> proto::Datum {
        cookbook_datum(
            vec![run(Source::Prompt, id, 0, 3), run(Source::Sampled, id, 0, 1)],
            vec![run(Source::Prompt, id, 1, 2), run(Source::Sampled, id, 0, 2)],
        )
    }

    fn datum(targets: Vec<u32>, advantages: Vec<f32>) -> Datum {
        let inputs = LossFnInputs { target_tokens: Some(targets), advantages: Some(advantages), ..Default::default() };
        Datum { input_tokens: vec![1, 2, 3, 4], loss_fn_inputs: inputs }
    }

    #[test]
    fn tilings_are_checked() {
        let err = |d: &proto::Datum| from_proto(0, d, 4, 4).unwrap_err().message;
        assert_eq!(from_proto(0, &proto::Datum::default(), 4, 4).unwrap(), None);
        assert!(from_proto(0, &spans("s"), 4, 4).unwrap().is_some());
        assert!(from_proto(0, &spans("s"), 5, 4).unwrap_err().message.contains("cover 4 positions, not the 5"));
        assert!(from_proto(0, &spans("s"), 4, 3).unwrap_err().message.contains("more than the 3 target_tokens"));
        let half = cookbook_datum(spans("s").model_input_spans, vec![]);
        assert!(err(&half).contains("both or neither"));
        let negative = cookbook_datum(vec![run(Source::Prompt, "s", 0, -1)], spans("s").loss_fn_input_spans);
        assert!(err(&negative).contains("must be ≥ 0"));
        let anonymous = cookbook_datum(vec![run(Source::Prompt, "", 0, 4)], spans("s").loss_fn_input_spans);
        assert!(err(&anonymous).contains("no sequence_id"));
        let empty = cookbook_datum(vec![proto::ProvenanceSpan { span: None }], spans("s").loss_fn_input_spans);
        assert!(err(&empty).contains("neither prompt_tokens nor sampled_tokens"));
    }

    /// The recorded log-probs and a 0/1 mask replace what the client sent; every mismatch with
    /// the record is refused, naming it.
    #[test]
    fn resolve_takes_q_from_the_record() {
        let records = StabilityRecords::new(1000);
        records.record(Some("k"), Some("sess"), "s".into(), Arc::new(vec![1, 2, 3]), vec![4, 5], vec![-0.25, -1.5]);
        let p = from_proto(0, &spans("s"), 4, 4).unwrap();
        let mut data = vec![datum(vec![0, 0, 4, 5], vec![0.0, 0.0, 0.5, 0.5])];
        data[0].loss_fn_inputs.logprobs = Some(vec![9.0; 4]); // the client's copy is not used
        resolve(&records, Some("k"), "sess", &mut data, std::slice::from_ref(&p)).unwrap();
        assert_eq!(data[0].loss_fn_inputs.logprobs, Some(vec![0.0, 0.0, -0.25, -1.5]));
        assert_eq!(data[0].loss_fn_inputs.weights, Some(vec![0.0, 0.0, 1.0, 1.0]));

        let fails = |mut d: Datum, key: &str, p: &Option<Provenance>| {
            resolve(&records, Some(key), "sess", std::slice::from_mut(&mut d), std::slice::from_ref(p))
                .unwrap_err()
                .message
        };
        assert!(fails(datum(vec![0, 0, 4, 6], vec![0.0; 4]), "k", &p).contains("not the sampled tokens"));
        assert!(fails(datum(vec![0, 0, 4, 5], vec![0.0, 1.0, 0.0, 0.0]), "k", &p).contains("a prompt position"));
        assert!(fails(datum(vec![0, 0, 4, 5], vec![0.0; 4]), "other", &p).contains("unknown"));
        assert!(fails(datum(vec![0, 0, 4, 5], vec![0.0; 4]), "k", &None).contains("needs provenance"));
        let mut input = datum(vec![0, 0, 4, 5], vec![0.0; 4]);
        input.input_tokens[0] = 7;
        assert!(fails(input, "k", &p).contains("not the recorded tokens"));
        let long = cookbook_datum(
            vec![run(Source::Prompt, "s", 0, 3), run(Source::Sampled, "s", 0, 1)],
            vec![run(Source::Prompt, "s", 2, 2), run(Source::Sampled, "s", 0, 2)],
        );
        let long = from_proto(0, &long, 4, 4).unwrap();
        assert!(fails(datum(vec![0, 0, 4, 5], vec![0.0; 4]), "k", &long).contains("which it does not have"));
    }
}
