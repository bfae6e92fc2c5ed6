//! The transformer's training forward, recorded, and its hand-written backward, on the CPU.
//!
//! Training through candle's autograd pays, for every argument of every graph node, a zero-filled
//! gradient buffer and an add into it, and runs all but the matmuls on one thread. Here the model
//! (embedding, blocks, final norm, and the LM head; see [`crate::model::transformer`] for the
//! math) runs on plain slices: the forward keeps exactly what the backward reads (the [`Tape`]),
//! the backward walks the blocks in reverse writing each gradient once, into buffers it owns,
//! with every product a `gemm` call over the rayon pool (independent products side by side) and
//! every elementwise pass split over it too.
//!
//! Where the tape hands over to candle: a policy's target log-probs (and entropies)
//! ([`Tape::logprobs`], [`Tape::logprobs_and_entropy`]), or the final hidden states for anything
//! else that reads them (a value head; [`Tape::hidden`]). That output is a fresh candle variable;
//! the loss is a candle graph on it, and [`Tape::backward`] takes the gradient candle computed for
//! it and returns the gradient of every trainable tensor of the model, by tensor (a tied
//! embedding's two parts, the head's and the gather's, summed: the gathered rows added into the
//! head's part one by one). Numbers: the same operations as the candle path (the fused kernels'
//! slice functions of [`crate::model::ops`] are shared), equal to it up to float summation order
//! (tests/integration/model_tape.rs compares both in f64 and f32).
//!
//! Simplifications: no KV cache and no per-row adapters (training and scoring only); f64 models
//! compute in f64 and all others in f32 (bf16/f16 weights widened as they are read); other
//! devices keep candle's autograd ([`Tape::serves`]). The logits of the rows the loss reads are
//! kept for the backward ([M, V], as the candle path kept them), computed in chunks of rows.
//!
//! Activation checkpointing ([`Keep::LayerInputs`]): the forward keeps only each block's input
//! (and the attention mask) and the backward runs the block's forward again from it, just before
//! that block's backward, then drops what it recomputed; the head keeps no logits and recomputes
//! them chunk by chunk (`head`). Every kernel is deterministic (fixed splits, fixed summation
//! orders), so the recomputed activations, hence the gradients, are the bits of keeping
//! everything; the price is one more forward of the body and the head per backward.

mod attention;
mod delta_net;
mod gemma3;
mod head;
mod linear;
pub(crate) mod matmul;
mod moe;
mod rotary;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Storage, Tensor, Var, WithDType};

use super::attention_gate;
use super::ops::{rms_norm, Real};
use super::sharded_weights::{self, Unit};
use super::transformer::{attention_bias, Attention, Block, FeedForward, Mixer, Transformer};
use crate::{Error, Result};
use attention::Dims;
use head::WeightGradient;
pub use head::{vocab_blocks, CHUNK_LOGITS, VOCAB_BLOCK};

/// A tensor's contiguous CPU data as `T`: borrowed (read-locked) when the tensor is of dtype T,
/// else converted (a bf16/f16 model's weights, computed in f32).
pub(crate) enum Held<'t, T> {
    // candle's lock guard, whose type candle does not export.
    Borrowed { guard: Box<dyn std::ops::Deref<Target = Storage> + 't>, range: (usize, usize) },
    Converted(Vec<T>),
}

impl<'t, T: Real> Held<'t, T> {
    pub(crate) fn new(t: &'t Tensor) -> Result<Self> {
        if !t.device().is_cpu() {
            return Err(Error::input("tape: a weight is not in host memory"));
        }
        if t.dtype() != T::DTYPE {
            return Ok(Held::Converted(host::<T>(&t.to_dtype(T::DTYPE)?)?));
        }
        let (guard, layout) = t.storage_and_layout();
        let range = layout.contiguous_offsets().ok_or_else(|| Error::input("tape: a weight is not contiguous"))?;
        Ok(Held::Borrowed { guard: Box::new(guard), range })
    }

    pub(crate) fn slice(&self) -> Result<&[T]> {
        match self {
            Held::Borrowed { guard, range } => match &***guard {
                Storage::Cpu(c) => Ok(&c.as_slice::<T>()?[range.0..range.1]),
                _ => unreachable!("checked in Held::new"),
            },
            Held::Converted(v) => Ok(v),
        }
    }
}

/// Gradients of trainable tensors, as they are produced.
pub(crate) struct Grads<T> {
    list: Vec<(Tensor, Vec<T>)>,
}

impl<T: Real> Grads<T> {
    pub(crate) fn push(&mut self, param: &Tensor, grad: Vec<T>) {
        self.list.push((param.clone(), grad));
    }

    /// The gradient pushed for `param`, taken out of the list.
    fn remove(&mut self, param: &Tensor) -> Option<Vec<T>> {
        let at = self.list.iter().position(|(p, _)| p.id() == param.id())?;
        Some(self.list.remove(at).1)
    }

    /// The gradients pushed so far, as tensors of their parameters' shapes; the list is emptied.
    fn take(&mut self) -> Result<Vec<(Tensor, Tensor)>> {
        std::mem::take(&mut self.list)
            .into_iter()
            .map(|(p, g)| Ok((p.clone(), Tensor::from_vec(g, p.shape(), &Device::Cpu)?)))
            .collect()
    }
}

/// How much of the forward a [`Tape`] keeps for its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Nothing: no backward will follow (scoring).
    Nothing,
    /// Every block's activations.
    Everything,
    /// Each block's input only: the backward recomputes the block (activation checkpointing).
    LayerInputs,
}

/// What one block's backward reads.
struct BlockRecord<T> {
    h_in: Vec<T>,
    x_attn: Vec<T>,
    /// x·Aᵀ of each projection with an adapter, in [`Block::linears_mut`] order.
    u: Vec<Option<Vec<T>>>,
    mixer: MixerRecord<T>,
    h_mid: Vec<T>,
    x_mlp: Vec<T>,
    gate: Vec<T>,
    up: Vec<T>,
    act: Vec<T>,
    /// The mixer's and the MLP's outputs before Gemma 3's post-norms.
    post: Option<gemma3::PostRecord<T>>,
    /// A sparse MLP's record (gate, up and act are then empty).
    moe: Option<moe::TapeRecord<T>>,
}

/// What a token mixer's backward reads.
enum MixerRecord<T> {
    Attention(AttnRecord<T>),
    DeltaNet(delta_net::TapeRecord<T>),
}

/// What an attention mixer's backward reads.
struct AttnRecord<T> {
    /// q and k projections before the Qwen3 head norms (empty without them).
    q_pre: Vec<T>,
    k_pre: Vec<T>,
    /// Rotated q [B, H, T, D] and k [B, KV, T, D]; v in the projection layout.
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    p: Vec<T>,
    /// The o_proj input (gated when the attention has an output gate).
    attn: Vec<T>,
    /// With an output gate: the attention output before it, and the gate [B·T, H·D].
    attn_raw: Vec<T>,
    out_gate: Vec<T>,
}

/// A block as the forward left it: all its activations, or its input to recompute them from.
enum Kept<T> {
    All(Box<BlockRecord<T>>),
    Input(Vec<T>),
}

/// What every block's forward reads besides its input.
struct Shared<T> {
    dims: Dims,
    cos: Vec<T>,
    sin: Vec<T>,
    /// The additive attention mask [B, T, T].
    bias: Vec<T>,
    /// The key mask [B][T] (which tokens a DeltaNet layer reads).
    mask: Vec<Vec<u8>>,
    /// The sliding layers' tables and mask (Gemma 3).
    local: Option<gemma3::Local<T>>,
}

impl<T> Shared<T> {
    /// (cos, sin, bias) of a sliding or a global layer.
    fn attention_inputs(&self, sliding: bool) -> (&[T], &[T], &[T]) {
        match (&self.local, sliding) {
            (Some(l), true) => (&l.cos, &l.sin, &l.bias),
            _ => (&self.cos, &self.sin, &self.bias),
        }
    }
}

struct Record<T> {
    model: Transformer,
    tokens: Vec<u32>,
    /// `bias` is emptied unless a block is to be recomputed.
    shared: Shared<T>,
    blocks: Vec<Kept<T>>,
    h_last: Vec<T>,
    /// The body's output, the final hidden states [B·T, hidden].
    out: Vec<T>,
    head: Option<head::HeadRecord<T>>,
    /// Whether the head keeps its logits for the backward (else it recomputes them there, under
    /// activation checkpointing; without a backward it keeps nothing).
    keep_logits: bool,
    /// The sparse layers' routing statistics (a model with experts).
    router: Option<moe::RouterStats>,
}

enum Recorded {
    F32(Record<f32>),
    F64(Record<f64>),
}

/// Where the tape hands over to candle's graph: the variable candle differentiates the loss for.
enum Cut {
    None,
    /// The final hidden states [B, T, hidden].
    Hidden(Var),
    /// The target log-probs [M] and maybe the entropies [M] (the head ran on the tape).
    Logprobs(Var, Option<Var>),
}

/// The recorded forward of one micro-batch, waiting for its backward.
pub struct Tape {
    record: Recorded,
    cut: Cut,
}

impl Tape {
    /// Whether the tape can train `model`: on the CPU. f64 models compute in f64, all others in
    /// f32 (bf16/f16 weights are widened as they are read: the CPU has no fast half-precision
    /// matmul in candle, and f32 activations only make the result closer to f32 training).
    pub fn serves(model: &Transformer) -> bool {
        model.device.is_cpu() && matches!(model.dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// Runs the body on a batch (inputs as [`Transformer::forward_hidden`] takes them, without a
    /// cache), keeping the activations only when asked to (`record`: a backward will follow).
    /// Its output is then read through [`Tape::hidden`] or [`Tape::logprobs`].
    pub fn forward(
        model: &Transformer,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
        record: bool,
    ) -> Result<Tape> {
        let keep = if record { Keep::Everything } else { Keep::Nothing };
        Tape::forward_keeping(model, input_ids, positions, mask, keep)
    }

    /// [`Tape::forward`] keeping what `keep` says for the backward.
    pub fn forward_keeping(
        model: &Transformer,
        input_ids: &[Vec<u32>],
        positions: &[Vec<u32>],
        mask: &[Vec<u8>],
        keep: Keep,
    ) -> Result<Tape> {
        if !Tape::serves(model) {
            return Err(Error::input("tape: CPU models only"));
        }
        model.check_inputs(input_ids, positions, mask)?;
        let record = match model.dtype {
            DType::F64 => Recorded::F64(run(model, input_ids, positions, mask, keep)?),
            _ => Recorded::F32(run(model, input_ids, positions, mask, keep)?),
        };
        Ok(Tape { record, cut: Cut::None })
    }

    /// The final hidden states [B, T, hidden] as a fresh variable, in the model's dtype: the
    /// caller's graph (head, loss) starts there, and the backward continues from its gradient.
    pub fn hidden(&mut self) -> Result<Tensor> {
        let (hidden, dtype) = match &self.record {
            Recorded::F32(r) => (r.hidden()?, r.model.dtype),
            Recorded::F64(r) => (r.hidden()?, r.model.dtype),
        };
        self.model().release_unit(Unit::Head)?;
        let var = Var::from_tensor(&hidden)?;
        let out = var.as_tensor().to_dtype(dtype)?;
        self.cut = Cut::Hidden(var);
        Ok(out)
    }

    /// log p(targets\[i\]) at the flattened position rows\[i\] (row-major over [B, T]) as a fresh
    /// variable: the LM head and the log-softmax run on the tape too.
    pub fn logprobs(&mut self, rows: &[u32], targets: &[u32]) -> Result<Tensor> {
        Ok(self.tempered_logprobs(rows, targets, 1.0, false)?.0)
    }

    /// [`Tape::logprobs`] and the entropy of each row's distribution, both fresh variables.
    pub fn logprobs_and_entropy(&mut self, rows: &[u32], targets: &[u32]) -> Result<(Tensor, Tensor)> {
        let (lp, h) = self.tempered_logprobs(rows, targets, 1.0, true)?;
        Ok((lp, h.expect("asked for")))
    }

    /// [`Tape::logprobs`] (and, with `entropy`, the entropies) of softmax(logits ·
    /// `inv_temperature`): the distribution a sampler at temperature 1 / `inv_temperature` draws
    /// from, the logits scaled in their dtype as the sampler scales them.
    pub fn tempered_logprobs(
        &mut self,
        rows: &[u32],
        targets: &[u32],
        inv_temperature: f64,
        entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if rows.len() != targets.len() {
            return Err(Error::input(format!("{} rows but {} targets", rows.len(), targets.len())));
        }
        if !(inv_temperature.is_finite() && inv_temperature > 0.0) {
            return Err(Error::input(format!(
                "tape: 1 / temperature must be finite and positive, not {inv_temperature}"
            )));
        }
        let (lp, h) = match &mut self.record {
            Recorded::F32(r) => head_forward(r, rows, targets, entropy, inv_temperature)?,
            Recorded::F64(r) => head_forward(r, rows, targets, entropy, inv_temperature)?,
        };
        self.model().release_unit(Unit::Head)?;
        let lp = Var::from_tensor(&lp)?;
        let h = h.map(|h| Var::from_tensor(&h)).transpose()?;
        let out = (lp.as_tensor().clone(), h.as_ref().map(|h| h.as_tensor().clone()));
        self.cut = Cut::Logprobs(lp, h);
        Ok(out)
    }

    /// The gradients of the body's (and head's) trainable tensors, given the store that
    /// candle's backward of the loss filled. Empty when the loss did not depend on the tape's
    /// output.
    pub fn backward(self, store: &GradStore) -> Result<Vec<(Tensor, Tensor)>> {
        let mut all = vec![];
        self.backward_by_unit(
            store,
            &mut |_, grads| {
                all.extend(grads);
                Ok(())
            },
            None,
        )?;
        Ok(all)
    }

    /// [`Tape::backward`], handing each unit's gradients to `sink` as soon as that unit's
    /// backward is done, in the order of [`sharded_weights::gradient_units`] (every unit, with
    /// an empty list where it has none), so that no more than one unit's gradients are held here
    /// at once. The concatenation of the lists is [`Tape::backward`]'s. With `head` (a model whose
    /// head [`Tape::streams_head`]), the head weight's gradient goes there instead, block by block.
    pub fn backward_by_unit(
        self,
        store: &GradStore,
        sink: &mut UnitSink<'_>,
        head: Option<&mut dyn HeadSink>,
    ) -> Result<()> {
        if head.is_some() && !Tape::streams_head(self.model()) {
            return Err(Error::Other("tape: this model's head gradient cannot be handed over in blocks".into()));
        }
        let host = |v: Option<&Var>| v.and_then(|v| store.get(v.as_tensor())).map(|g| g.flatten_all()).transpose();
        // No gradient reached the tape's output: the loss did not depend on it. A sharded model's
        // other ranks still gather every unit of their backward, so this one walks them too.
        // (A head sink completes its sums from the unit callbacks.)
        let nothing = |model: &Transformer, sink: &mut UnitSink<'_>| -> Result<()> {
            walk_backward(model.weight_gate.as_ref().map(|g| &*g.0), model.layers.len(), sink)
        };
        let (g, g_entropy, through_head) = match &self.cut {
            Cut::None => return Err(Error::input("tape: backward before its output was read")),
            Cut::Hidden(v) => match host(Some(v))? {
                Some(g) => (g, None, false),
                None => return nothing(self.model(), sink),
            },
            Cut::Logprobs(lp, h) => {
                let g_entropy = host(h.as_ref())?;
                let g = match (host(Some(lp))?, &g_entropy) {
                    (Some(g), _) => g,
                    // Only the entropies reached the loss.
                    (None, Some(_)) => lp.zeros_like()?,
                    (None, None) => return nothing(self.model(), sink),
                };
                (g, g_entropy, true)
            }
        };
        match self.record {
            Recorded::F32(r) => {
                let ge = g_entropy.map(|g| g.to_vec1::<f32>()).transpose()?;
                backward(r, &g.to_vec1::<f32>()?, ge.as_deref(), through_head, sink, head)
            }
            Recorded::F64(r) => {
                let ge = g_entropy.map(|g| g.to_vec1::<f64>()).transpose()?;
                backward(r, &g.to_vec1::<f64>()?, ge.as_deref(), through_head, sink, head)
            }
        }
    }
}

/// Where [`Tape::backward_by_unit`] hands each unit's gradients: (parameter, gradient) pairs.
pub type UnitSink<'a> = dyn FnMut(Unit, Vec<(Tensor, Tensor)>) -> Result<()> + 'a;

/// Where [`Tape::backward_by_unit`] hands a trained head weight's gradient block by block
/// ([`VOCAB_BLOCK`] vocabulary rows at a time) instead of whole with the head unit's others:
/// `sharding = "full"` sums each block to the weight's owner as soon as it is made, so that no
/// rank holds the whole vocabulary-sized gradient (`worker/head_stream.rs`).
///
/// A tied head's rows that the embedding's backward adds to as well ("hot": the tokens of
/// every rank's batch) are final only then: their head part is kept aside, the gathered rows
/// are added to it in the usual order at the end of the backward, and they are handed over
/// again whole. A row no rank's batch holds gets nothing from the embedding, so its head part
/// is final at once: the bits are those of the whole gradient.
pub trait HeadSink {
    /// This rank's hot rows (its batch's tokens, sorted, each once) in, every rank's out
    /// (sorted): asked once before the head's backward, for a tied head only.
    fn hot_rows(&mut self, mine: Vec<u32>) -> Result<Vec<u32>>;
    /// Rows `first..` of the head weight's gradient [rows, width]: final but for the hot rows.
    fn rows(&mut self, first: usize, grad: Tensor) -> Result<()>;
    /// The hot rows' gradients [hot, width], in `hot_rows`' order (a tied head, at the end).
    fn hot(&mut self, grad: Tensor) -> Result<()>;
}

/// The backward of a rank that has nothing to differentiate: each unit gathered and released
/// (through `gate`, when the model is sharded) and handed to `sink` with no gradients, in the
/// order a real backward visits them.
pub fn walk_backward(
    gate: Option<&dyn sharded_weights::UnitGather>,
    layers: usize,
    sink: &mut UnitSink<'_>,
) -> Result<()> {
    for unit in sharded_weights::gradient_units(layers) {
        if let (Some(gate), true) = (gate, unit != Unit::Embed) {
            gate.gather(unit)?;
            gate.release(unit)?;
        }
        sink(unit, vec![])?;
    }
    Ok(())
}

impl Tape {
    /// The forward's load-balancing loss over its real tokens (a model with experts): see
    /// `moe::RouterStats`.
    pub fn router_aux_loss(&self) -> Option<f64> {
        match &self.record {
            Recorded::F32(r) => r.router.as_ref().map(moe::RouterStats::loss),
            Recorded::F64(r) => r.router.as_ref().map(moe::RouterStats::loss),
        }
    }

    /// Makes the backward add `scale` × the load-balancing loss's gradient (no effect without
    /// experts).
    pub fn set_router_aux_scale(&mut self, scale: f64) {
        let stats = match &mut self.record {
            Recorded::F32(r) => r.router.as_mut(),
            Recorded::F64(r) => r.router.as_mut(),
        };
        if let Some(s) = stats {
            s.scale = scale;
        }
    }

    /// Whether [`Tape::backward_by_unit`] can hand `model`'s head weight over in blocks ([`HeadSink`]):
    /// a trained head without a bias or an adapter, and, when tied, an embedding without a
    /// scale (a scaled one's gradient is scaled after its rows are summed).
    pub fn streams_head(model: &Transformer) -> bool {
        let head = &model.lm_head;
        let tied = head.weight.id() == model.embed_tokens.id();
        head.weight.is_variable()
            && head.bias.is_none()
            && head.lora.is_none()
            && !(tied && model.config.gemma3.is_some())
    }

    fn model(&self) -> &Transformer {
        match &self.record {
            Recorded::F32(r) => &r.model,
            Recorded::F64(r) => &r.model,
        }
    }
}

impl<T: Real> Record<T> {
    fn hidden(&self) -> Result<Tensor> {
        let Dims { b, t, .. } = self.shared.dims;
        Ok(Tensor::from_slice(&self.out, self.out.len(), &Device::Cpu)?.reshape((b, t, ()))?)
    }
}

fn head_forward<T: Real>(
    r: &mut Record<T>,
    rows: &[u32],
    targets: &[u32],
    entropy: bool,
    inv_temperature: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    let n = r.shared.dims.b * r.shared.dims.t;
    if let Some(bad) = rows.iter().find(|&&i| i as usize >= n) {
        return Err(Error::input(format!("tape: row {bad} is beyond the batch's {n} positions")));
    }
    let width = r.model.config.hidden_size;
    let options = head::HeadForward { entropy, keep_logits: r.keep_logits, budget: CHUNK_LOGITS, inv_temperature };
    let (lp, h, rec) = head::forward(&r.model.lm_head, &r.out, width, rows, targets, options)?;
    r.head = Some(rec);
    let tensor = |v: Vec<T>| Tensor::from_vec(v, rows.len(), &Device::Cpu);
    Ok((tensor(lp)?, h.map(tensor).transpose()?))
}

fn host<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.flatten_all()?.to_vec1::<T>()?)
}

fn add_into<T: Real>(acc: &mut [T], x: &[T]) {
    use rayon::prelude::*;
    acc.par_chunks_mut(16_384).zip(x.par_chunks(16_384)).for_each(|(a, x)| {
        for (a, &x) in a.iter_mut().zip(x) {
            *a += x;
        }
    });
}

fn sum<T: Real>(a: &[T], b: &[T]) -> Vec<T> {
    let mut out = a.to_vec();
    add_into(&mut out, b);
    out
}

fn run<T: Real>(
    model: &Transformer,
    input_ids: &[Vec<u32>],
    positions: &[Vec<u32>],
    mask: &[Vec<u8>],
    keep: Keep,
) -> Result<Record<T>> {
    let c = &model.config;
    let (b, t) = (input_ids.len(), input_ids[0].len());
    let hd = c.hidden_size;
    let dims = Dims { b, t, h: c.num_attention_heads, kvh: c.num_key_value_heads, d: c.head_dim };
    let (cos, sin) = model.rope.tables(positions, T::DTYPE)?;
    let (cos, sin) = (host::<T>(&cos)?, host::<T>(&sin)?);
    let bias = host::<T>(&attention_bias(mask, 0, t, &Device::Cpu)?.to_dtype(T::DTYPE)?)?;
    let local = gemma3::Local::new(model, positions, mask)?;
    let mut shared = Shared { dims, cos, sin, bias, mask: mask.to_vec(), local };
    let tokens = input_ids.concat();

    let mut h = vec![T::of(0.0); b * t * hd];
    model.gather_unit(Unit::Embed)?;
    {
        let embed = Held::<T>::new(&model.embed_tokens)?;
        let embed = embed.slice()?;
        for (row, &tok) in h.chunks_mut(hd).zip(&tokens) {
            row.copy_from_slice(&embed[tok as usize * hd..(tok as usize + 1) * hd]);
        }
    }
    if let Some(s) = gemma3::embedding_scale::<T>(model)? {
        gemma3::scale_embeddings(&mut h, s);
    }
    model.release_unit(Unit::Embed)?;
    let mut blocks = Vec::with_capacity(model.layers.len());
    let mut router = c.moe.as_ref().map(|m| moe::RouterStats::new(m.num_experts));
    let real = mask.concat();
    for (i, layer) in model.layers.iter().enumerate() {
        model.gather_unit(Unit::Layer(i))?;
        let (h_out, rec) = block_forward(model, layer, h, &shared)?;
        if let (Some(stats), Some(mr)) = (router.as_mut(), rec.moe.as_ref()) {
            stats.add(&mr.routing, &real);
        }
        model.release_unit(Unit::Layer(i))?;
        h = h_out;
        match keep {
            Keep::Nothing => {}
            Keep::Everything => blocks.push(Kept::All(Box::new(rec))),
            Keep::LayerInputs => blocks.push(Kept::Input(rec.h_in)),
        }
    }
    if keep != Keep::LayerInputs {
        shared.bias = vec![];
        if let Some(l) = shared.local.as_mut() {
            l.bias = vec![];
        }
    }
    // Held until the head has run ([`Tape::logprobs`] or [`Tape::hidden`] releases it).
    model.gather_unit(Unit::Head)?;
    let out = model_norm(model, &h, &model.norm)?;
    let keep_logits = keep == Keep::Everything;
    Ok(Record { model: model.clone(), tokens, shared, blocks, h_last: h, out, head: None, keep_logits, router })
}

/// One block's forward from its input `h`: its output, and every activation its backward reads
/// (the input included). The backward of a checkpointed tape calls it again on the same input:
/// one function for both, so the recomputed activations are the forward's bits.
fn block_forward<T: Real>(
    model: &Transformer,
    layer: &Block,
    h: Vec<T>,
    shared: &Shared<T>,
) -> Result<(Vec<T>, BlockRecord<T>)> {
    let n = shared.dims.b * shared.dims.t;
    let x_attn = model_norm(model, &h, &layer.input_layernorm)?;
    let (o, mut u, mixer) = match &layer.mixer {
        Mixer::Attention(a) => attention_forward(model, a, &x_attn, shared)?,
        Mixer::DeltaNet(dn) => {
            let (o, u, rec) = delta_net::forward(model, dn, &x_attn, shared)?;
            (o, u, MixerRecord::DeltaNet(rec))
        }
    };
    let (o, o_raw) = gemma3::forward(model, layer, |p| &p.attn, o)?;
    let h_mid = sum(&h, &o);
    drop(o);
    let x_mlp = model_norm(model, &h_mid, &layer.post_attention_layernorm)?;
    let m = match &layer.mlp {
        FeedForward::Dense(m) => m,
        FeedForward::Sparse(sparse) => {
            let (down, rec) = moe::forward(sparse, &x_mlp, n, model.config.hidden_size)?;
            let h_out = sum(&h_mid, &down);
            let (gate, up, act) = (vec![], vec![], vec![]);
            let rec =
                BlockRecord { h_in: h, x_attn, u, mixer, h_mid, x_mlp, gate, up, act, post: None, moe: Some(rec) };
            return Ok((h_out, rec));
        }
    };
    let (gate, up) =
        rayon::join(|| linear::forward(&m.gate_proj, &x_mlp, n), || linear::forward(&m.up_proj, &x_mlp, n));
    let ((gate, ug), (up, uu)) = (gate?, up?);
    let act = gemma3::activation(model, &gate, &up);
    let (down, ud) = linear::forward(&m.down_proj, &act, n)?;
    let (down, down_raw) = gemma3::forward(model, layer, |p| &p.mlp, down)?;
    let h_out = sum(&h_mid, &down);
    u.extend([ug, uu, ud]);
    let post = o_raw.zip(down_raw).map(|(attn, mlp)| gemma3::PostRecord { attn, mlp });
    let rec = BlockRecord { h_in: h, x_attn, u, mixer, h_mid, x_mlp, gate, up, act, post, moe: None };
    Ok((h_out, rec))
}

/// An attention mixer's forward: the o_proj output, the adapters' u of q, k, v, o, and the
/// record.
#[allow(clippy::type_complexity)]
fn attention_forward<T: Real>(
    model: &Transformer,
    a: &Attention,
    x_attn: &[T],
    shared: &Shared<T>,
) -> Result<(Vec<T>, Vec<Option<Vec<T>>>, MixerRecord<T>)> {
    let c = &model.config;
    let dims = &shared.dims;
    let (cos, sin, bias) = shared.attention_inputs(a.sliding);
    let (t, d, h) = (dims.t, dims.d, dims.h);
    let n = dims.b * t;
    let scale = model.config.attention_scale();
    // Independent projections side by side (see linear::backward).
    let (q, kv) = rayon::join(
        || linear::forward(&a.q_proj, x_attn, n),
        || rayon::join(|| linear::forward(&a.k_proj, x_attn, n), || linear::forward(&a.v_proj, x_attn, n)),
    );
    let ((q, uq), (k, uk), (v, uv)) = (q?, kv.0?, kv.1?);
    // With an output gate q_proj gives [q | gate] per head.
    let (q, out_gate) = match a.output_gate {
        true => {
            let (mut qs, mut gs) = (Vec::with_capacity(n * h * d), Vec::with_capacity(n * h * d));
            for head in q.chunks(2 * d) {
                qs.extend_from_slice(&head[..d]);
                gs.extend_from_slice(&head[d..]);
            }
            (qs, gs)
        }
        false => (q, vec![]),
    };
    let (q_pre, k_pre, q, k) = match (&a.q_norm, &a.k_norm) {
        (Some(qn), Some(kn)) => {
            let qn_out = model_norm(model, &q, qn)?;
            let kn_out = model_norm(model, &k, kn)?;
            (q, k, qn_out, kn_out)
        }
        _ => (vec![], vec![], q, k),
    };
    let q = rotary::forward(&q, cos, sin, (t, dims.h, d), c.rotary_dim);
    let k = rotary::forward(&k, cos, sin, (t, dims.kvh, d), c.rotary_dim);
    let (p, attn) = attention::forward(&q, &k, &v, bias, *dims, scale);
    let (attn, attn_raw) = match a.output_gate {
        true => (attention_gate::forward(&attn, &out_gate), attn),
        false => (attn, vec![]),
    };
    let (o, uo) = linear::forward(&a.o_proj, &attn, n)?;
    let rec = AttnRecord { q_pre, k_pre, q, k, v, p, attn, attn_raw, out_gate };
    Ok((o, vec![uq, uk, uv, uo], MixerRecord::Attention(rec)))
}

/// An attention mixer's backward from the gradient of its output `dh`: the gradient of its
/// input x_attn.
#[allow(clippy::too_many_arguments)]
fn attention_backward<T: Real>(
    model: &Transformer,
    a: &Attention,
    rec: &AttnRecord<T>,
    x_attn: &[T],
    u: &[Option<Vec<T>>],
    dh: &[T],
    shared: &Shared<T>,
    grads: &mut Grads<T>,
) -> Result<Vec<T>> {
    let dims = shared.dims;
    let Dims { b, t, h, kvh, d } = dims;
    let n = b * t;
    let scale = model.config.attention_scale();
    let rd = model.config.rotary_dim;
    let u = |k: usize| u[k].as_deref();
    let mut d_attn = None;
    linear::backward(&a.o_proj, &rec.attn, u(3), dh, n, &mut d_attn, grads)?;
    let mut d_attn = d_attn.expect("set by the backward");
    let mut d_gate = vec![];
    if a.output_gate {
        (d_attn, d_gate) = attention_gate::backward(&rec.attn_raw, &rec.out_gate, &d_attn);
    }
    let (dq, dk, dv) = attention::backward(&rec.q, &rec.k, &rec.v, &rec.p, &d_attn, dims, scale);
    let (cos, sin, _) = shared.attention_inputs(a.sliding);
    let mut dq = rotary::backward(&dq, cos, sin, (t, h, d), rd);
    let mut dk = rotary::backward(&dk, cos, sin, (t, kvh, d), rd);
    if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
        let mut dq_pre = vec![T::of(0.0); dq.len()];
        rms_norm_backward(model, &rec.q_pre, &dq, qn, &mut dq_pre, grads)?;
        let mut dk_pre = vec![T::of(0.0); dk.len()];
        rms_norm_backward(model, &rec.k_pre, &dk, kn, &mut dk_pre, grads)?;
        (dq, dk) = (dq_pre, dk_pre);
    }
    if a.output_gate {
        // Back to q_proj's [q | gate] per head.
        let mut both = Vec::with_capacity(2 * dq.len());
        for (q, g) in dq.chunks(d).zip(d_gate.chunks(d)) {
            both.extend_from_slice(q);
            both.extend_from_slice(g);
        }
        dq = both;
    }
    let mut dx = None;
    linear::backward(&a.q_proj, x_attn, u(0), &dq, n, &mut dx, grads)?;
    linear::backward(&a.k_proj, x_attn, u(1), &dk, n, &mut dx, grads)?;
    linear::backward(&a.v_proj, x_attn, u(2), &dv, n, &mut dx, grads)?;
    Ok(dx.expect("set by the backward"))
}

/// The weight a model's RMSNorm scales by, as `T`: `1 + w` for Qwen3.5 (summed in `T`, as the
/// candle path sums it), else w.
fn norm_weight<T: Real>(model: &Transformer, w: &Tensor) -> Result<Vec<T>> {
    let held = Held::<T>::new(w)?;
    let ws = held.slice()?;
    Ok(match model.config.norm_unit_offset {
        true => ws.iter().map(|&x| x + T::of(1.0)).collect(),
        false => ws.to_vec(),
    })
}

/// A model's RMSNorm of x ([`norm_weight`]).
fn model_norm<T: Real>(model: &Transformer, x: &[T], w: &Tensor) -> Result<Vec<T>> {
    Ok(rms_norm::forward(x, &norm_weight::<T>(model, w)?, model.config.rms_norm_eps))
}

/// dx of a model's RMSNorm added into `acc`, and the weight's gradient pushed when it trains
/// (the same for w as for 1 + w).
fn rms_norm_backward<T: Real>(
    model: &Transformer,
    x: &[T],
    gy: &[T],
    w: &Tensor,
    acc: &mut [T],
    grads: &mut Grads<T>,
) -> Result<()> {
    let ws = norm_weight::<T>(model, w)?;
    let mut dw = vec![T::of(0.0); ws.len()];
    rms_norm::backward(x, gy, &ws, model.config.rms_norm_eps, acc, &mut dw);
    if w.is_variable() {
        grads.push(w, dw);
    }
    Ok(())
}

/// The backward from the gradient of the cut: the hidden states, or the head's log-probs.
fn backward<T: Real>(
    mut r: Record<T>,
    g: &[T],
    g_entropy: Option<&[T]>,
    through_head: bool,
    sink: &mut UnitSink<'_>,
    mut head_sink: Option<&mut dyn HeadSink>,
) -> Result<()> {
    let head_record = r.head.take();
    let blocks = std::mem::take(&mut r.blocks);
    let model = &r.model;
    let c = &model.config;
    let Dims { b, t, .. } = r.shared.dims;
    let n = b * t;
    let (hd, im) = (c.hidden_size, c.intermediate_size);
    if blocks.len() != model.layers.len() {
        return Err(Error::input("tape: backward of a forward that did not record"));
    }
    let mut grads = Grads { list: vec![] };
    let aux = r.router.as_ref().and_then(|s| s.dprobs::<T>(&r.shared.mask.concat()));
    let tied = model.lm_head.weight.id() == model.embed_tokens.id();
    model.gather_unit(Unit::Head)?;
    // Handing the head's gradient over: the hot rows (a tied head) and their head part.
    let mut hot = match head_sink.as_deref_mut() {
        Some(hs) if tied => {
            let mut mine = r.tokens.clone();
            mine.sort_unstable();
            mine.dedup();
            let rows = hs.hot_rows(mine)?;
            let grad = vec![T::of(0.0); rows.len() * hd];
            Some((rows, grad))
        }
        _ => None,
    };
    let d_hidden = match (head_record, head_sink.as_deref_mut()) {
        (Some(rec), None) if through_head => {
            head::backward(&model.lm_head, rec, g, g_entropy, n, hd, VOCAB_BLOCK, &mut grads, WeightGradient::Whole)?
        }
        (Some(rec), Some(hs)) if through_head => {
            let mut hand = |first: usize, part: Vec<T>| -> Result<()> {
                let end = first + part.len() / hd;
                if let Some((rows, grad)) = hot.as_mut() {
                    let at = rows.partition_point(|&t| (t as usize) < first);
                    for (k, &t) in rows.iter().enumerate().skip(at).take_while(|&(_, &t)| (t as usize) < end) {
                        let src = (t as usize - first) * hd;
                        grad[k * hd..(k + 1) * hd].copy_from_slice(&part[src..src + hd]);
                    }
                }
                hs.rows(first, Tensor::from_vec(part, (end - first, hd), &Device::Cpu)?)
            };
            let to = WeightGradient::Blocks(&mut hand);
            head::backward(&model.lm_head, rec, g, g_entropy, n, hd, VOCAB_BLOCK, &mut grads, to)?
        }
        _ => g.to_vec(),
    };
    let mut dh = vec![T::of(0.0); n * hd];
    rms_norm_backward(model, &r.h_last, &d_hidden, &model.norm, &mut dh, &mut grads)?;
    model.release_unit(Unit::Head)?;
    let embedding_scale = gemma3::embedding_scale::<T>(model)?;
    // A tied head's part waits here for the embedding's rows, added into it below: one
    // vocabulary-sized buffer at the end of the backward instead of two. (A scaled embedding
    // scales the rows' sum alone, so it keeps a buffer of its own.)
    let tied_part = match embedding_scale {
        None => grads.remove(&model.embed_tokens),
        Some(_) => None,
    };
    sink(Unit::Head, grads.take()?)?;
    // Each block's activations are dropped once its backward has read them.
    for (i, (layer, kept)) in model.layers.iter().zip(blocks).enumerate().rev() {
        model.gather_unit(Unit::Layer(i))?;
        let rec = match kept {
            Kept::All(rec) => *rec,
            Kept::Input(h_in) => block_forward(model, layer, h_in, &r.shared)?.1,
        };
        let dx = match (&layer.mlp, &rec.moe) {
            (FeedForward::Sparse(sparse), Some(mr)) => {
                moe::backward(sparse, mr, &rec.x_mlp, &dh, n, hd, aux.as_deref(), &mut grads)?
            }
            (FeedForward::Dense(m), None) => {
                let mlp_u = rec.u.len() - 3;
                let u = |k: usize| rec.u[k].as_deref();
                // h_out = h_mid + down(swiglu(gate(x), up(x))), x = rms_norm(h_mid)
                let mut d_act = None;
                let d_down =
                    gemma3::backward(model, layer, |p| &p.mlp, rec.post.as_ref().map(|p| &p.mlp[..]), &dh, &mut grads)?;
                let d_down = d_down.as_deref().unwrap_or(&dh);
                linear::backward(&m.down_proj, &rec.act, u(mlp_u + 2), d_down, n, &mut d_act, &mut grads)?;
                let d_act = d_act.expect("set by the backward");
                let (mut d_gate, mut d_up) = (vec![T::of(0.0); n * im], vec![T::of(0.0); n * im]);
                gemma3::activation_backward(model, &rec.gate, &rec.up, &d_act, &mut d_gate, &mut d_up);
                drop(d_act);
                let mut dx = None;
                linear::backward(&m.gate_proj, &rec.x_mlp, u(mlp_u), &d_gate, n, &mut dx, &mut grads)?;
                linear::backward(&m.up_proj, &rec.x_mlp, u(mlp_u + 1), &d_up, n, &mut dx, &mut grads)?;
                dx.expect("set by the backward")
            }
            _ => return Err(Error::Other("tape: a block's record does not match its MLP".into())),
        };
        rms_norm_backward(model, &rec.h_mid, &dx, &layer.post_attention_layernorm, &mut dh, &mut grads)?;
        // h_mid = h_in + mixer(rms_norm(h_in))
        let dx = match (&layer.mixer, &rec.mixer) {
            (Mixer::Attention(a), MixerRecord::Attention(ar)) => {
                let post = rec.post.as_ref().map(|p| &p.attn[..]);
                let d_o = gemma3::backward(model, layer, |p| &p.attn, post, &dh, &mut grads)?;
                let d_o = d_o.as_deref().unwrap_or(&dh);
                attention_backward(model, a, ar, &rec.x_attn, &rec.u, d_o, &r.shared, &mut grads)?
            }
            (Mixer::DeltaNet(dn), MixerRecord::DeltaNet(dr)) => {
                delta_net::backward(model, dn, dr, &rec.x_attn, &rec.u, &dh, &r.shared, &mut grads)?
            }
            _ => return Err(Error::Other("tape: a block's record does not match its mixer".into())),
        };
        rms_norm_backward(model, &rec.h_in, &dx, &layer.input_layernorm, &mut dh, &mut grads)?;
        model.release_unit(Unit::Layer(i))?;
        sink(Unit::Layer(i), grads.take()?)?;
    }
    if let (Some((rows, mut grad)), Some(hs)) = (hot, head_sink) {
        // A tied head handed over: the gathered rows added into the hot rows' head part, in
        // the order the whole gradient adds them.
        for (row, &tok) in dh.chunks(hd).zip(&r.tokens) {
            let k =
                rows.binary_search(&tok).map_err(|_| Error::Other(format!("tape: token {tok} is not a hot row")))?;
            for (a, &g) in grad[k * hd..(k + 1) * hd].iter_mut().zip(row) {
                *a += g;
            }
        }
        hs.hot(Tensor::from_vec(grad, (rows.len(), hd), &Device::Cpu)?)?;
    } else if model.embed_tokens.is_variable() {
        let mut d_embed = tied_part.unwrap_or_else(|| vec![T::of(0.0); c.vocab_size * hd]);
        for (row, &tok) in dh.chunks(hd).zip(&r.tokens) {
            for (a, &g) in d_embed[tok as usize * hd..(tok as usize + 1) * hd].iter_mut().zip(row) {
                *a += g;
            }
        }
        if let Some(s) = embedding_scale {
            // d(e·s)/de = s, on the summed rows (the scale is a constant).
            gemma3::scale_embeddings(&mut d_embed, s);
        }
        grads.push(&model.embed_tokens, d_embed);
    }
    sink(Unit::Embed, grads.take()?)
}
