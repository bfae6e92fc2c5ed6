//! One micro-batch: right-pad its datums, run the model, gather the real tokens, apply the loss.
//!
//! Datums are right-padded to the longest (pad id 0, positions continuing, key mask 0), so a
//! real token never sees a pad (attention is causal). The final hidden states of the real
//! tokens are gathered into one flat [N, hidden] tensor (N = Σ lengths, datums in micro-batch
//! order), so the LM head, log-probs, entropy and loss never touch a padded position. Per-token
//! loss inputs are concatenated the same way. Log-probs are in the model's dtype, at least f32.

use candle_core::{DType, Device, Tensor};

use super::adamw::state_dtype;
use super::batch::{Datum, FloatField};
use super::value_head::ValueHead;
use crate::algo::{Loss, LossInputs, LossOutput, Metrics};
use crate::model::graph_checkpoint::GraphCheckpoint;
use crate::model::logprobs::{entropy as token_entropy, target_logprobs_and_lse};
use crate::model::ops::head_logprobs;
use crate::model::tape::{Keep, Tape};
use crate::model::Transformer;
use crate::Result;

/// The model's per-token outputs for the real tokens of one micro-batch, flat [N].
pub struct TokenOutputs {
    /// Log-probs of the targets (policy) or values (critic): the differentiable loss input.
    pub main: Tensor,
    pub entropy: Option<Tensor>,
    /// Datum lengths, in micro-batch order.
    pub lengths: Vec<usize>,
    /// The model's recorded forward, when it ran on the tape: its backward completes candle's.
    pub tape: Option<Tape>,
    /// Off the tape with activation checkpointing: the blocks' inputs, for the backward.
    pub graph: Option<GraphCheckpoint>,
}

/// What a policy's head computes besides the target log-probs.
#[derive(Clone, Copy, Debug)]
pub struct HeadOptions {
    /// Per-token entropies too.
    pub entropy: bool,
    /// 1 / the temperature: log-probs (and entropies) of softmax(logits · inv_temperature).
    pub inv_temperature: f64,
}

/// Runs the model on the datums `members` of `batch`. `critic` selects the value head;
/// `head` says what a policy's head computes (entropies, the temperature). The model runs on the [`Tape`] where it
/// can (the CPU), keeping what `keep` says for a backward (anything but [`Keep::Nothing`]): the
/// caller then hands the tape candle's gradients. Off the tape, [`Keep::LayerInputs`] runs the
/// blocks through a [`GraphCheckpoint`] (activation checkpointing on candle's graph).
pub fn model_outputs(
    model: &Transformer,
    value_head: Option<&ValueHead>,
    batch: &[Datum],
    members: &[usize],
    head: HeadOptions,
    keep: Keep,
) -> Result<TokenOutputs> {
    let HeadOptions { entropy, inv_temperature } = head;
    let backward = keep != Keep::Nothing;
    let lengths: Vec<usize> = members.iter().map(|&i| batch[i].len()).collect();
    let t_max = *lengths.iter().max().expect("a micro-batch is never empty");
    let mut ids = Vec::with_capacity(members.len());
    let mut positions = Vec::with_capacity(members.len());
    let mut mask = Vec::with_capacity(members.len());
    let mut gather = Vec::with_capacity(lengths.iter().sum());
    for (row, &i) in members.iter().enumerate() {
        let tokens = &batch[i].input_tokens;
        let n = tokens.len();
        ids.push(tokens.iter().copied().chain(std::iter::repeat_n(0, t_max - n)).collect::<Vec<u32>>());
        positions.push((0..t_max as u32).collect::<Vec<u32>>());
        mask.push((0..t_max).map(|t| u8::from(t < n)).collect::<Vec<u8>>());
        gather.extend((0..n).map(|t| (row * t_max + t) as u32));
    }
    let device = &model.device;
    let n_real = gather.len();
    let targets = || -> Vec<u32> {
        members
            .iter()
            .flat_map(|&i| {
                batch[i]
                    .loss_fn_inputs
                    .target_tokens
                    .as_ref()
                    .expect("validated: target_tokens present")
                    .iter()
                    .copied()
            })
            .collect()
    };
    let mut tape =
        if Tape::serves(model) { Some(Tape::forward_keeping(model, &ids, &positions, &mask, keep)?) } else { None };
    // A policy: the head runs on the tape as well.
    if let (Some(t), None) = (tape.as_mut(), value_head) {
        let (logprobs, entropy) = t.tempered_logprobs(&gather, &targets(), inv_temperature, entropy)?;
        return Ok(TokenOutputs { main: logprobs, entropy, lengths, tape: tape.filter(|_| backward), graph: None });
    }
    let (hidden, graph) = match tape.as_mut() {
        Some(t) => (t.hidden()?, None),
        None if keep == Keep::LayerInputs => {
            let (hidden, graph) = GraphCheckpoint::forward(model, &ids, &positions, &mask)?;
            (hidden, Some(graph))
        }
        None => (model.forward_hidden(&ids, &positions, &mask, None)?, None),
    };
    let tape = tape.filter(|_| backward);
    let hidden_size = hidden.dim(2)?;
    let hidden = hidden.reshape((members.len() * t_max, hidden_size))?;
    // Rows of padding are dropped; without any, the gather (and its backward, a scatter-add)
    // would copy every row to where it is.
    let hidden = match n_real == members.len() * t_max {
        true => hidden,
        false => hidden.index_select(&Tensor::from_vec(gather, n_real, device)?, 0)?,
    };
    let dtype = state_dtype(model.dtype);
    if let Some(head) = value_head {
        let values = head.forward(&hidden)?.to_dtype(dtype)?;
        return Ok(TokenOutputs { main: values, entropy: None, lengths, tape, graph });
    }
    let targets = Tensor::from_vec(targets(), n_real, device)?;
    // On a GPU the head and the log-probs are one graph node (the logits are no edge of the
    // graph); the entropy reads the logits, an adapted head has more than a weight.
    let lm_head = &model.lm_head;
    let one_node = device.is_cuda()
        && !entropy
        && lm_head.bias.is_none()
        && lm_head.lora.is_none()
        && lm_head.weight.dtype() == hidden.dtype()
        && head_logprobs::serves(device, hidden.dtype());
    if one_node {
        let (logprobs, _) = head_logprobs::head_logprobs(&hidden, &lm_head.weight, &targets, inv_temperature)?;
        return Ok(TokenOutputs { main: logprobs, entropy: None, lengths, tape, graph });
    }
    let mut logits = lm_head.forward(&hidden)?.to_dtype(dtype)?;
    if inv_temperature != 1.0 {
        logits = (logits * inv_temperature)?;
    }
    let (logprobs, lse) = target_logprobs_and_lse(&logits, &targets)?;
    let entropy = if entropy { Some(token_entropy(&logits, &lse)?) } else { None };
    Ok(TokenOutputs { main: logprobs, entropy, lengths, tape, graph })
}

/// The field concatenated over `members`, as a tensor of `dtype`, if the datums have it.
fn concat(
    batch: &[Datum],
    members: &[usize],
    field: FloatField,
    dtype: DType,
    device: &Device,
) -> Result<Option<Tensor>> {
    if batch[members[0]].loss_fn_inputs.float(field).is_none() {
        return Ok(None);
    }
    let flat: Vec<f32> = members
        .iter()
        .flat_map(|&i| batch[i].loss_fn_inputs.float(field).expect("validated: on every datum or none").iter().copied())
        .collect();
    let n = flat.len();
    Ok(Some(Tensor::from_vec(flat, n, device)?.to_dtype(dtype)?))
}

/// Applies `loss` to the micro-batch outputs. Returns the loss output and the weights [N].
pub fn apply_loss(
    loss: &Loss,
    outputs: &TokenOutputs,
    batch: &[Datum],
    members: &[usize],
) -> Result<(LossOutput, Tensor)> {
    let (dtype, device) = (outputs.main.dtype(), outputs.main.device());
    let get = |field| concat(batch, members, field, dtype, device);
    let n: usize = outputs.lengths.iter().sum();
    let weights = match get(FloatField::Weights)? {
        Some(w) => w,
        None => Tensor::ones(n, dtype, device)?,
    };
    // Each datum field goes to the loss input of the same name; the model's output is the
    // learner's.
    let mut inputs = LossInputs::new(weights.clone());
    match loss {
        Loss::Value(_) => {
            inputs.learner_values = Some(outputs.main.clone());
            inputs.values = get(FloatField::Values)?;
            inputs.returns = get(FloatField::Returns)?;
        }
        _ => {
            inputs.learner_logprobs = Some(outputs.main.clone());
            inputs.logprobs = get(FloatField::Logprobs)?;
            inputs.rollout_logprobs = match get(FloatField::RolloutLogprobs)? {
                Some(roll) => Some(roll),
                None => inputs.logprobs.clone(),
            };
            inputs.advantages = get(FloatField::Advantages)?;
            inputs.ref_logprobs = get(FloatField::RefLogprobs)?;
            inputs.entropy = outputs.entropy.clone();
            let sequence_ids: Vec<u32> =
                outputs.lengths.iter().enumerate().flat_map(|(s, &len)| std::iter::repeat_n(s as u32, len)).collect();
            inputs.sequence_ids = Some(Tensor::from_vec(sequence_ids, n, device)?);
        }
    }
    Ok((loss.compute(&inputs)?, weights))
}

/// Splits a flat host vector into one vector per datum of the micro-batch.
pub fn split(flat: Vec<f32>, lengths: &[usize]) -> Vec<Vec<f32>> {
    let mut rest = flat.as_slice();
    lengths
        .iter()
        .map(|&n| {
            let (head, tail) = rest.split_at(n);
            rest = tail;
            head.to_vec()
        })
        .collect()
}

/// Sampled tokens (nonzero weight) whose experts differ between the sampler's forward and the
/// trainer's ([`crate::model::moe::router_mismatch`]), each datum run alone.
pub fn router_mismatch(model: &Transformer, batch: &[Datum]) -> Result<usize> {
    let mut count = 0;
    for d in batch {
        let n = d.input_tokens.len();
        let weights = match d.loss_fn_inputs.float(FloatField::Weights) {
            Some(w) => w.clone(),
            None => vec![1.0; n],
        };
        let ids = [d.input_tokens.clone()];
        count +=
            crate::model::moe::router_mismatch(model, &ids, &[(0..n as u32).collect()], &[vec![1; n]], &[weights])?;
    }
    Ok(count)
}

/// Adds the load-balancing loss of a model with experts to a micro-batch's backward, weighted by
/// `coef` × the sum of its datums' loss weights (see `WorkerConfig::router_aux_loss_coef`), and
/// its value to `metrics` (`router_aux_loss:sum`). Nothing when `coef` is 0.
pub fn router_aux_loss(tape: &mut Tape, batch: &[Datum], members: &[usize], coef: f64, metrics: &mut Metrics) {
    if coef == 0.0 {
        return;
    }
    let Some(aux) = tape.router_aux_loss() else { return };
    let weight: f64 = members
        .iter()
        .map(|&i| match batch[i].loss_fn_inputs.float(FloatField::Weights) {
            Some(w) => w.iter().map(|&x| x as f64).sum(),
            None => batch[i].len() as f64,
        })
        .sum();
    tape.set_router_aux_scale(coef * weight);
    metrics.add_sum("router_aux_loss", coef * weight * aux);
}
