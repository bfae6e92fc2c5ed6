//! The token embedding as one node of candle's graph: h = E[ids] (rows of the table E [V, D]),
//! with its backward dE[v] = Σ dh[i] over the positions i of token v.
//!
//! candle's backward of `index_select` adds the rows into a zero table with `index_add`, whose
//! CUDA kernel gives a thread to each of the D columns and walks every position in turn: D
//! threads for a whole batch's tokens. Here the host, which holds the ids, groups the positions
//! by token (in position order) once at the forward, and the backward's kernel
//! (`cuda/embedding.cu`) gives a block to each token that occurs, its threads taking the
//! columns: every element receives the same additions in the same order as `index_add`'s, from
//! zero, so the gradient is its bits. Where the node does not serve (the CPU, candle's kernels),
//! [`embedding`] is candle's `index_select` and [`table_gradient`] `index_add` into zeros.

#[cfg(feature = "cuda")]
use candle_core::Layout;
use candle_core::{CustomOp1, Tensor};

use super::custom_op::cpu_refused;
use super::fused;
use super::node_output::{forward_from_out, NodeOutput};
use crate::{Error, Result};

/// Whether the node and its kernel serve a table: on CUDA with oxrl's kernels on.
pub fn serves(table: &Tensor) -> bool {
    table.device().is_cuda() && fused(table)
}

/// The rows `ids` of `table` [V, D] as [ids.len(), D].
pub fn embedding(table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    let vocab = table.dim(0)?;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(Error::input(format!("token id {bad} is out of range for the embedding's {vocab} rows")));
    }
    let index = Tensor::from_slice(ids, ids.len(), table.device())?;
    if !(table.track_op() && serves(table)) {
        return Ok(table.index_select(&index, 0)?);
    }
    let rows = table.detach().index_select(&index, 0)?;
    let groups = Groups::of(ids, table.device())?;
    Ok(table.apply_op1(EmbeddingNode { out: NodeOutput::new("embedding", rows), groups })?)
}

/// dE [V, D] for the rows' gradient `g` [ids.len(), D] (zero at tokens that do not occur): the
/// backward of [`embedding`], and of candle's `index_select` where the node does not serve.
pub fn table_gradient(table: &Tensor, ids: &[u32], g: &Tensor) -> Result<Tensor> {
    let (vocab, width) = table.dims2()?;
    if g.dims() != [ids.len(), width] {
        return Err(Error::input(format!("embedding gradient {:?} for {} ids of width {width}", g.dims(), ids.len())));
    }
    if !serves(table) {
        let index = Tensor::from_slice(ids, ids.len(), table.device())?;
        return Ok(table.zeros_like()?.index_add(&index, &g.to_dtype(table.dtype())?, 0)?);
    }
    let groups = Groups::of(ids, table.device())?;
    groups.gradient(&g.to_dtype(table.dtype())?, vocab)
}

/// The positions grouped by token, as the kernel reads them: `tokens` [U] (each token that
/// occurs, ascending), `starts` [U + 1] and `order` [N] (token tokens[b]'s positions are
/// order[starts[b] .. starts[b + 1]], ascending).
struct Groups {
    tokens: Tensor,
    starts: Tensor,
    order: Tensor,
}

impl Groups {
    fn of(ids: &[u32], device: &candle_core::Device) -> Result<Self> {
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&i| (ids[i as usize], i));
        let (mut tokens, mut starts) = (vec![], vec![]);
        for (k, &i) in order.iter().enumerate() {
            if tokens.last() != Some(&ids[i as usize]) {
                tokens.push(ids[i as usize]);
                starts.push(k as u32);
            }
        }
        starts.push(order.len() as u32);
        let tensor = |v: Vec<u32>| Tensor::from_vec(v.clone(), v.len(), device);
        Ok(Groups { tokens: tensor(tokens)?, starts: tensor(starts)?, order: tensor(order)? })
    }

    /// dE [vocab, D] from the rows' gradient g [N, D] (the kernel; CUDA only).
    fn gradient(&self, g: &Tensor, vocab: usize) -> Result<Tensor> {
        let width = g.dim(1)?;
        let out = Tensor::zeros((vocab, width), g.dtype(), g.device())?;
        let op = TableGradient { tokens: self.tokens.clone(), starts: self.starts.clone(), order: self.order.clone() };
        out.inplace_op2(&g.contiguous()?, &op)?;
        Ok(out)
    }
}

/// The graph node: its output (computed before the node exists) and the grouped positions.
struct EmbeddingNode {
    out: NodeOutput,
    groups: Groups,
}

impl CustomOp1 for EmbeddingNode {
    fn name(&self) -> &'static str {
        "embedding"
    }

    forward_from_out!(s1 l1);

    fn bwd(&self, table: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = grad.to_dtype(table.dtype())?;
        let dtable = self.groups.gradient(&g, table.dim(0)?).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok(Some(dtable))
    }
}

/// The kernel, writing the rows of the tokens that occur into a zero table (in place).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct TableGradient {
    tokens: Tensor,
    starts: Tensor,
    order: Tensor,
}

impl candle_core::InplaceOp2 for TableGradient {
    fn name(&self) -> &'static str {
        "embedding-gradient"
    }

    cpu_refused!(inplace 2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        out: &mut candle_core::cuda_backend::CudaStorage,
        out_l: &Layout,
        g: &candle_core::cuda_backend::CudaStorage,
        g_l: &Layout,
    ) -> candle_core::Result<()> {
        use super::cuda::{self, launch};
        let width = *g_l.dims().last().expect("the gradient is [N, D]");
        let groups = self.tokens.elem_count();
        let (t, t_l) = self.tokens.storage_and_layout();
        let (s, s_l) = self.starts.storage_and_layout();
        let (o, o_l) = self.order.storage_and_layout();
        let group = |storage, what| cuda::held(storage, "embedding gradient", what);
        let (tokens, starts, order) = (
            cuda::view::<u32>(group(&t, "tokens")?, t_l)?,
            cuda::view::<u32>(group(&s, "starts")?, s_l)?,
            cuda::view::<u32>(group(&o, "order")?, o_l)?,
        );
        let (a, b) = out_l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("embedding gradient: the table is not contiguous".into()))?;
        let dev = out.device.clone();
        let wi = width as i64;
        macro_rules! run {
            ($slice:ident, $T:ty) => {{
                let dy = cuda::view::<$T>(g, g_l)?;
                let candle_core::cuda_backend::CudaStorageSlice::$slice(dst) = &mut out.slice else {
                    return Err(candle_core::Error::Msg("embedding gradient: the table and the rows differ in dtype".into()));
                };
                let mut dst = dst.slice_mut(a..b);
                launch!(dev, cuda::EMBEDDING, cuda::entry::<$T>("embedding_grad"), cuda::per_row(groups);
                    &tokens, &starts, &order, &dy, &mut dst, &wi);
                Ok(())
            }};
        }
        match &g.slice {
            candle_core::cuda_backend::CudaStorageSlice::F32(_) => run!(F32, f32),
            candle_core::cuda_backend::CudaStorageSlice::BF16(_) => run!(BF16, half::bf16),
            candle_core::cuda_backend::CudaStorageSlice::F16(_) => run!(F16, half::f16),
            _ => Err(candle_core::Error::Msg("embedding gradient: f32, bf16 or f16 only".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::bits;
    use candle_core::{Device, Var};

    /// On the CPU the embedding is candle's gather and its gradient candle's: the same values
    /// and table gradient as `index_select`'s backward; ids past the table are an error.
    #[test]
    fn the_cpu_embedding_is_candles_gather() {
        let w: Vec<f32> = (0..7 * 3).map(|i| (i as f32 * 0.37).sin()).collect();
        let table = Var::from_tensor(&Tensor::from_vec(w, (7, 3), &Device::Cpu).unwrap()).unwrap();
        let ids = [3u32, 0, 3, 6, 3];
        let c = Tensor::from_vec((0..15).map(|i| i as f32 * 0.1 - 0.7).collect::<Vec<f32>>(), (5, 3), &Device::Cpu)
            .unwrap();
        let rows = embedding(table.as_tensor(), &ids).unwrap();
        let index = Tensor::new(&ids, &Device::Cpu).unwrap();
        let chain = table.as_tensor().index_select(&index, 0).unwrap();
        assert_eq!(bits(&rows), bits(&chain));
        let g = (rows * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let want = (chain * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let (g, want) = (g.get(table.as_tensor()).unwrap(), want.get(table.as_tensor()).unwrap());
        assert_eq!(bits(g), bits(want));
        assert_eq!(bits(&table_gradient(table.as_tensor(), &ids, &c).unwrap()), bits(want));
        assert!(embedding(table.as_tensor(), &[7]).is_err());
        assert!(table_gradient(table.as_tensor(), &ids, &c.narrow(0, 0, 4).unwrap()).is_err());
    }
}
