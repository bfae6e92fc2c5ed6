//! Flash attention: [`super::attention`]'s output softmax(scale · q kᵀ + bias) v as [B, T, H·D]
//! and its gradients, computed tile by tile so that the scores and probabilities [B, H, T, S]
//! are never in memory (the kernels: `cuda/flash_attention.cu`). CUDA, bf16 or f16, head
//! dimension 64 or 128; products on the tensor cores with f32 accumulators, the softmax in f32.
//!
//! ```text
//! forward   per row: m = max_s x, l = Σ_s exp(x − m)   (x = scale · q·k_s + bias, a pass over the keys)
//!           out = Σ_s round(exp(x − m) / l) · v_s       (a second pass; (m, 1 / l) kept)
//! backward  delta = Σ_d dO ⊙ out                        (= Σ_s p ⊙ dp)
//!           p again from x and (m, 1 / l); dp = dO · vᵀ; ds = scale · p · (dp − delta)
//!           dq = ds · k,  dk = Σ_heads dsᵀ · q,  dv = Σ_heads pᵀ · dO  (per query head in f32,
//!           then the heads sharing a kv head summed in order)
//! ```
//! Each gradient element is summed in a fixed order (no atomics): the same bits every run. They
//! are not the unfused node's bits (its products and sums run in other orders), but the same
//! probabilities rounded at the same places (p before the weighted sum, ds before its
//! products), so within bf16's rounding of them (`tests/gpu.rs` compares the two).
//!
//! The forward first classifies the bias's 32 × 32 tiles (a table kept for the backward): tiles
//! masked throughout are skipped (the causal future, left padding; their keys weigh exactly 0 in
//! any row that sees a key, and every row of the model's attention bias sees its own position),
//! tiles of zeros are not read, and only the rest (the diagonal's, padding's edges) read the bias.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{CustomOp3, DType, Device, Tensor};

use super::custom_op::cpu_refused;
use super::node_output::{forward_from_out, NodeOutput, SideOutput};
use super::{cached_attention, cuda_kernels};
use crate::Result;

/// The head dimensions the kernels are built for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Whether the kernels were built: their 16-bit tensor-core tiles need a build for compute
/// capability 8.0 or later (`CUDA_COMPUTE_CAP`, see build.rs).
const BUILT: bool = match option_env!("OXRL_CUDA_COMPUTE_CAP") {
    Some(cap) => at_least_80(cap.as_bytes()),
    None => false,
};

/// Whether a compute capability written in decimal digits ("75", "90", "100") is 80 or more.
const fn at_least_80(digits: &[u8]) -> bool {
    let (mut value, mut i) = (0u32, 0);
    while i < digits.len() {
        if !digits[i].is_ascii_digit() {
            return false;
        }
        value = value * 10 + (digits[i] - b'0') as u32;
        i += 1;
    }
    value >= 80
}

/// Whether [`flash_attention`] serves q [B, H, T, D]: on CUDA with oxrl's kernels on (built for
/// compute capability 8.0 or later), in bf16 or f16, D one of [`HEAD_DIMS`], unless
/// `OXRL_FLASH_ATTENTION=0` (read once) or [`set_flash_attention`]`(false)`: the switch is
/// there to measure the unfused node against it.
pub fn serves(q: &Tensor) -> bool {
    BUILT
        && switched_on()
        && matches!(q.device(), Device::Cuda(_))
        && cuda_kernels()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && q.dims().last().is_some_and(|d| HEAD_DIMS.contains(d))
}

/// Whether flash attention is switched on (see [`serves`] for where it runs).
pub fn switched_on() -> bool {
    switch().load(Ordering::Relaxed)
}

/// Turns flash attention on or off for the whole process (see [`serves`]).
pub fn set_flash_attention(on: bool) {
    switch().store(on, Ordering::Relaxed);
}

fn switch() -> &'static AtomicBool {
    static ON: std::sync::OnceLock<AtomicBool> = std::sync::OnceLock::new();
    ON.get_or_init(|| AtomicBool::new(std::env::var("OXRL_FLASH_ATTENTION").as_deref() != Ok("0")))
}

/// The attention output [B, T, H·D] for q [B, H, T, D], k and v [B, KV, S, D] and the additive
/// bias [B, T, S] (see the module docs): a graph node when any input tracks a gradient. An error
/// where the kernels do not run (see [`serves`]).
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    cached_attention::check(q, k, v, bias)?;
    let (b, h, t, _) = q.dims4()?;
    let bias = bias.to_dtype(DType::F32)?.contiguous()?;
    let forward = Forward { bias: bias.clone(), scale, stats: SideOutput::default(), tiles: SideOutput::default() };
    let (qc, kc, vc) = (q.detach().contiguous()?, k.detach().contiguous()?, v.detach().contiguous()?);
    let out = qc.apply_op3_no_bwd(&kc, &vc, &forward)?;
    let stats = forward.stats.take("flash-attention", (b * h * t, 2))?;
    let (_, _, s, _) = k.dims4()?;
    let tiles = forward.tiles.take("flash-attention", (b, t.div_ceil(TILE), s.div_ceil(TILE)))?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    let node = FlashNode { out: NodeOutput::new("flash-attention", out), bias, tiles, stats, scale };
    Ok(q.apply_op3(k, v, node)?)
}

/// The side of the bias table's square tiles (the kernels' `G`).
const TILE: usize = 32;

/// The forward kernels on (q, k, v): the output; each row's (max, 1 / sum) and the bias table
/// (u8 [B, ⌈T / 32⌉, ⌈S / 32⌉]) its side outputs.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Forward {
    bias: Tensor,
    scale: f64,
    stats: SideOutput,
    tiles: SideOutput,
}

/// The graph node: its output (computed before the node exists) and what the backward reads.
struct FlashNode {
    out: NodeOutput,
    bias: Tensor,
    /// The bias table (see [`Forward`]).
    tiles: Tensor,
    /// Each row's (max, 1 / sum) [B·H·T, 2], f32.
    stats: Tensor,
    scale: f64,
}

impl CustomOp3 for FlashNode {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    forward_from_out!(s1 l1, s2 l2, s3 l3);

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let backward = Backward {
            bias: self.bias.clone(),
            tiles: self.tiles.clone(),
            stats: self.stats.clone(),
            out: out.contiguous()?,
            d_out: grad.contiguous()?,
            scale: self.scale,
            dk: SideOutput::default(),
            dv: SideOutput::default(),
        };
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let dq = q.apply_op3_no_bwd(&k, &v, &backward)?;
        let m = |e: crate::Error| candle_core::Error::Msg(e.to_string());
        let dk = backward.dk.take("flash-attention backward", k.shape()).map_err(m)?;
        let dv = backward.dv.take("flash-attention backward", v.shape()).map_err(m)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The backward kernels on (q, k, v) with the forward's output, its gradient and row stats: dq,
/// with dk and dv its second and third outputs.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Backward {
    bias: Tensor,
    tiles: Tensor,
    stats: Tensor,
    out: Tensor,
    d_out: Tensor,
    scale: f64,
    dk: SideOutput,
    dv: SideOutput,
}

/// The `cuda_fwd` of an op on (q, k, v) whose kernels are `kernels::$run::<T>`, for T of bf16
/// and f16.
macro_rules! cuda_fwd_16_bit {
    ($run:ident) => {
        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            qs: &candle_core::cuda_backend::CudaStorage,
            ql: &candle_core::Layout,
            ks: &candle_core::cuda_backend::CudaStorage,
            kl: &candle_core::Layout,
            vs: &candle_core::cuda_backend::CudaStorage,
            vl: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, candle_core::Shape)> {
            use candle_core::cuda_backend::CudaStorageSlice::{BF16, F16};
            let inputs = [(qs, ql), (ks, kl), (vs, vl)];
            match &qs.slice {
                BF16(_) => kernels::$run::<half::bf16>(self, inputs),
                F16(_) => kernels::$run::<half::f16>(self, inputs),
                _ => Err(kernels::not_16_bit()),
            }
        }
    };
}

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    cpu_refused!(3);

    cuda_fwd_16_bit!(forward);
}

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "flash-attention-backward"
    }

    cpu_refused!(3);

    cuda_fwd_16_bit!(backward);
}

/// The launches.
#[cfg(feature = "cuda")]
mod kernels {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::cuda_backend::CudaStorage;
    use candle_core::{Layout, Shape};

    use super::super::cuda::{self, launch, Elem};
    use super::{Backward, Forward, TILE};

    type Inputs<'a> = [(&'a CudaStorage, &'a Layout); 3];

    pub(super) fn not_16_bit() -> candle_core::Error {
        candle_core::Error::Msg("flash attention: bf16 or f16 only".into())
    }

    /// The problem's sizes: (B, H, KV, T, S, D).
    fn sizes(q: &Layout, k: &Layout) -> candle_core::Result<[usize; 6]> {
        let (b, h, t, d) = q.shape().dims4()?;
        let (_, kvh, s, _) = k.shape().dims4()?;
        if !super::HEAD_DIMS.contains(&d) {
            return Err(candle_core::Error::Msg(format!("flash attention: head dimension {d}, not 64 or 128")));
        }
        Ok([b, h, kvh, t, s, d])
    }

    /// A block of 128 threads (the kernels' four warps) for each of `tiles` × `y` × `b`.
    fn blocks(tiles: usize, y: usize, b: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (tiles as u32, y as u32, b as u32), block_dim: (128, 1, 1), shared_mem_bytes: 0 }
    }

    pub(super) fn forward<T: Elem>(
        op: &Forward,
        [(qs, ql), (ks, kl), (vs, vl)]: Inputs<'_>,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let [b, h, kvh, t, s, d] = sizes(ql, kl)?;
        let (bias_storage, bias_layout) = op.bias.storage_and_layout();
        let bias = cuda::view::<f32>(cuda::held(&bias_storage, "flash attention", "bias")?, bias_layout)?;
        let (q, k, v) = (cuda::view::<T>(qs, ql)?, cuda::view::<T>(ks, kl)?, cuda::view::<T>(vs, vl)?);
        let out = cuda::output::<T>(qs, b * t * h * d)?;
        let stats = cuda::output::<f32>(qs, 2 * b * h * t)?;
        let [hi, kvi, ti, si] = [h, kvh, t, s].map(|v| v as i64);
        let scale = op.scale as f32;
        let (rows, cols) = (t.div_ceil(TILE), s.div_ceil(TILE));
        // Safety: the table kernel writes every entry.
        let tiles = unsafe { qs.device.alloc::<u8>((b * rows * cols).max(1)) }?;
        let one_warp =
            LaunchConfig { grid_dim: (cols as u32, rows as u32, b as u32), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        launch!(qs.device, cuda::FLASH_ATTENTION, "flash_attention_tiles", one_warp; &bias, &tiles, &ti, &si);
        launch!(qs.device, cuda::FLASH_ATTENTION, format!("flash_attention_fwd_d{d}_{}", T::SUFFIX), blocks(t.div_ceil(64), h, b);
            &q, &k, &v, &bias, &tiles, &out, &stats, &hi, &kvi, &ti, &si, &scale);
        op.stats.put(CudaStorage::wrap_cuda_slice(stats, qs.device.clone()));
        op.tiles.put(CudaStorage::wrap_cuda_slice(tiles, qs.device.clone()));
        Ok((cuda::storage(qs, out), Shape::from((b, t, h * d))))
    }

    pub(super) fn backward<T: Elem>(
        op: &Backward,
        [(qs, ql), (ks, kl), (vs, vl)]: Inputs<'_>,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let [b, h, kvh, t, s, d] = sizes(ql, kl)?;
        let rows = b * t * h;
        let table = [b, t.div_ceil(TILE), s.div_ceil(TILE)];
        if op.stats.dims() != [b * h * t, 2]
            || op.tiles.dims() != table
            || op.out.dims() != [b, t, h * d]
            || op.d_out.dims() != [b, t, h * d]
        {
            return Err(candle_core::Error::Msg(format!(
                "flash attention backward: q {:?}, k {:?}, stats {:?}, bias table {:?}, output {:?}, its gradient {:?}",
                ql.dims(),
                kl.dims(),
                op.stats.dims(),
                op.tiles.dims(),
                op.out.dims(),
                op.d_out.dims()
            )));
        }
        let (bias_storage, bias_layout) = op.bias.storage_and_layout();
        let bias = cuda::view::<f32>(cuda::held(&bias_storage, "flash attention", "bias")?, bias_layout)?;
        let (tiles_storage, tiles_layout) = op.tiles.storage_and_layout();
        let tiles = cuda::view::<u8>(cuda::held(&tiles_storage, "flash attention", "bias table")?, tiles_layout)?;
        let (stats_storage, stats_layout) = op.stats.storage_and_layout();
        let stats = cuda::view::<f32>(cuda::held(&stats_storage, "flash attention", "row stats")?, stats_layout)?;
        let (out_storage, out_layout) = op.out.storage_and_layout();
        let out = cuda::view::<T>(cuda::held(&out_storage, "flash attention", "output")?, out_layout)?;
        let (d_out_storage, d_out_layout) = op.d_out.storage_and_layout();
        let d_out = cuda::view::<T>(cuda::held(&d_out_storage, "flash attention", "output's gradient")?, d_out_layout)?;
        let (q, k, v) = (cuda::view::<T>(qs, ql)?, cuda::view::<T>(ks, kl)?, cuda::view::<T>(vs, vl)?);
        let delta = cuda::output::<f32>(qs, rows)?;
        let [ri, di, hi, kvi, ti, si] = [rows, d, h, kvh, t, s].map(|v| v as i64);
        let scale = op.scale as f32;
        launch!(qs.device, cuda::FLASH_ATTENTION, cuda::entry::<T>("flash_attention_delta"), cuda::per_warp_row(rows);
            &d_out, &out, &delta, &ri, &di);
        let dq = cuda::output::<T>(qs, b * h * t * d)?;
        launch!(qs.device, cuda::FLASH_ATTENTION, format!("flash_attention_dq_d{d}_{}", T::SUFFIX), blocks(t.div_ceil(64), h, b);
            &q, &k, &v, &bias, &tiles, &stats, &d_out, &delta, &dq, &hi, &kvi, &ti, &si, &scale);
        // A block per 64 keys and query head, into f32 parts; then each kv head's parts summed.
        let (dk_part, dv_part) = (cuda::output::<f32>(qs, b * h * s * d)?, cuda::output::<f32>(qs, b * h * s * d)?);
        launch!(qs.device, cuda::FLASH_ATTENTION, format!("flash_attention_dkv_d{d}_{}", T::SUFFIX), blocks(s.div_ceil(64), h, b);
            &q, &k, &v, &bias, &tiles, &stats, &d_out, &delta, &dk_part, &dv_part, &hi, &kvi, &ti, &si, &scale);
        let total = b * kvh * s * d;
        let (dk, dv) = (cuda::output::<T>(qs, total)?, cuda::output::<T>(qs, total)?);
        let [rep, per_head, total_i] = [h / kvh, s * d, total].map(|v| v as i64);
        launch!(qs.device, cuda::FLASH_ATTENTION, cuda::entry::<T>("flash_attention_dkv_sum"), cuda::elementwise(total);
            &dk_part, &dv_part, &dk, &dv, &rep, &per_head, &total_i);
        op.dk.put(cuda::storage(qs, dk));
        op.dv.put(cuda::storage(qs, dv));
        Ok((cuda::storage(qs, dq), ql.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_capabilities_from_80_build_the_kernels() {
        for (cap, built) in [("75", false), ("80", true), ("89", true), ("90", true), ("100", true), ("9x", false)] {
            assert_eq!(at_least_80(cap.as_bytes()), built, "{cap}");
        }
    }

    /// On the CPU it never serves, and called anyway it is an error that names it.
    #[test]
    fn the_cpu_gets_an_error_naming_the_op() {
        let q = Tensor::zeros((1, 2, 3, 64), DType::F32, &Device::Cpu).unwrap();
        let k = Tensor::zeros((1, 1, 3, 64), DType::F32, &Device::Cpu).unwrap();
        let bias = Tensor::zeros((1, 3, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(!serves(&q));
        let e = flash_attention(&q, &k, &k, &bias, 0.125).unwrap_err().to_string();
        assert!(e.contains("flash-attention"), "{e}");
    }
}
