//! log p(seq\[i\] | seq[..i]) of whole sequences through the trainer's forward: what `oxrl score`
//! reports and what the engine's prompt log-probs must equal, bit for bit.
//!
//! The batch is laid out as the trainer lays out a micro-batch (each sequence's first L − 1 tokens
//! as input, right-padded with id 0, positions 0.., key mask 0 on the padding) and run on the
//! [`Tape`] without keeping anything for a backward, the LM head and the log-softmax on the tape
//! too (`Tape::logprobs`): the same kernels in the same order as a training step, so a token's
//! log-prob here is the bits the trainer computes for it, and those the engine samples it with.
//! Off the CPU the trainer's candle path is taken (final hidden states of the real tokens, the LM
//! head, `target_logprobs`). Each row is independent in every kernel, so batching and padding
//! change no bit.

use candle_core::{DType, Tensor};

use super::logprobs::target_logprobs;
use super::tape::Tape;
use super::Transformer;
use crate::{Error, Result};

/// For each sequence, log p(seq\[i\] | seq[..i]) for i = 1..L (L − 1 values; none for one token).
pub fn sequence_logprobs(model: &Transformer, seqs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
    if let Some(i) = seqs.iter().position(Vec::is_empty) {
        return Err(Error::input(format!("sequence {i} is empty")));
    }
    // Sequences of one token have nothing to score and take no row.
    let scored: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].len() > 1).collect();
    let mut out: Vec<Vec<f32>> = vec![vec![]; seqs.len()];
    if scored.is_empty() {
        return Ok(out);
    }
    let t = scored.iter().map(|&i| seqs[i].len() - 1).max().expect("not empty");
    let (mut ids, mut positions, mut mask) = (vec![], vec![], vec![]);
    let (mut rows, mut targets) = (vec![], vec![]);
    for (r, &i) in scored.iter().enumerate() {
        let s = &seqs[i];
        let n = s.len() - 1;
        ids.push(s[..n].iter().copied().chain(std::iter::repeat_n(0, t - n)).collect::<Vec<u32>>());
        positions.push((0..t as u32).collect::<Vec<u32>>());
        mask.push((0..t).map(|p| u8::from(p < n)).collect::<Vec<u8>>());
        rows.extend((0..n).map(|p| (r * t + p) as u32));
        targets.extend_from_slice(&s[1..]);
    }
    let flat: Vec<f32> = if Tape::serves(model) {
        let mut tape = Tape::forward(model, &ids, &positions, &mask, false)?;
        tape.logprobs(&rows, &targets)?.to_dtype(DType::F32)?.to_vec1()?
    } else {
        let hidden = model.forward_hidden(&ids, &positions, &mask, None)?;
        let width = hidden.dim(2)?;
        let dev = &model.device;
        let gather = Tensor::from_vec(rows.clone(), rows.len(), dev)?;
        let hidden = hidden.reshape((scored.len() * t, width))?.index_select(&gather, 0)?;
        let dtype = if model.dtype == DType::F64 { DType::F64 } else { DType::F32 };
        let logits = model.lm_head.forward(&hidden)?.to_dtype(dtype)?;
        let targets = Tensor::from_vec(targets, rows.len(), dev)?;
        target_logprobs(&logits, &targets)?.to_dtype(DType::F32)?.to_vec1()?
    };
    let mut rest = &flat[..];
    for &i in &scored {
        let (mine, next) = rest.split_at(seqs[i].len() - 1);
        out[i] = mine.to_vec();
        rest = next;
    }
    Ok(out)
}
