//! One token per row of logits, drawn on the GPU (`--features cuda`), so that a decode step
//! copies B tokens and log-probs to the host instead of B × V logits.
//!
//! Per row z (kernel `cuda/sample_rows.cu`, a block per row): m = max z and lse = m + ln Σ
//! exp(z − m) in f32, as the trainer's log-prob kernel reduces them. Greedy (1/T = 0) takes the
//! first index of m. Otherwise w_j = exp((z_j − m) / T) in f32, summed in f64, and the token is
//! the first j whose cumulative weight passes u · Σw, u in [0, 1) drawn on the host from the
//! row's random stream: the host sampler's inverse CDF (`rollout::sampler`), with the running
//! sum taken chunk by chunk. The log-prob is the model's z_y − lse when greedy or at T = 1,
//! else ln(w_y / Σw). Top-k / top-p truncation and top log-probs stay on the host.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::cuda::{self, dispatch_cuda, launch};
use crate::{Error, Result};

struct SampleRows;

impl CustomOp3 for SampleRows {
    fn name(&self) -> &'static str {
        "sample-rows"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(candle_core::Error::Msg("sample-rows runs on a GPU (the CPU samples in rollout::sampler)".into()))
    }

    fn cuda_fwd(
        &self,
        zs: &CudaStorage,
        zl: &Layout,
        ts: &CudaStorage,
        tl: &Layout,
        us: &CudaStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (b, v) = zl.shape().dims2()?;
        let (inv_t, u) = (cuda::view::<f32>(ts, tl)?, cuda::view::<f64>(us, ul)?);
        // Safety: the kernel writes both words of every row.
        let out = unsafe { zs.device.alloc::<u32>(2 * b.max(1)) }?;
        let vi = v as i64;
        dispatch_cuda!(zs, T => {
            let z = cuda::view::<T>(zs, zl)?;
            launch!(zs.device, cuda::SAMPLE_ROWS, cuda::entry::<T>("sample_rows"), cuda::per_row(b); &z, &inv_t, &u, &out, &vi);
            Ok(())
        })?;
        Ok((CudaStorage::wrap_cuda_slice(out, zs.device.clone()), Shape::from((b, 2))))
    }
}

/// A token and its log-prob for each row of `logits` [B, V] (on a GPU; f32, bf16 or f16), row r
/// drawn at 1 / temperature `inv_temperature[r]` (0: greedy) from the point `u[r]` in [0, 1).
/// A row with a NaN logit is an error naming it.
pub fn sample_rows(logits: &Tensor, inv_temperature: &[f32], u: &[f64]) -> Result<Vec<(u32, f32)>> {
    let (b, _) = logits.dims2()?;
    if inv_temperature.len() != b || u.len() != b {
        return Err(Error::input(format!(
            "sample_rows: {b} rows of logits, {} temperatures, {} random points",
            inv_temperature.len(),
            u.len()
        )));
    }
    let dev = logits.device();
    let (inv_t, u) = (Tensor::from_slice(inv_temperature, b, dev)?, Tensor::from_slice(u, b, dev)?);
    let out = logits.contiguous()?.apply_op3_no_bwd(&inv_t, &u, &SampleRows)?.to_vec2::<u32>()?;
    out.into_iter()
        .enumerate()
        .map(|(i, r)| match r[0] {
            u32::MAX => Err(Error::Other(format!("the model produced NaN logits (or none) in batch row {i}"))),
            token => Ok((token, f32::from_bits(r[1]))),
        })
        .collect()
}
