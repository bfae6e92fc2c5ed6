//! The output of a graph node whose value is computed before the node exists (candle operations
//! on detached inputs: [`super::attention`], [`super::linear`], [`super::head_logprobs`]), handed
//! to candle once by the node's forward, which then only records the node and its inputs.
//!
//! And [`SideOutput`]: a CUDA op's second output (a candle op returns one), left by its
//! `cuda_fwd` and taken once the op has run.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Shape, Storage, Tensor};

/// The precomputed output, until the node's forward takes it.
pub(crate) struct NodeOutput {
    out: Mutex<Option<Tensor>>,
    /// The node's name, for errors.
    node: &'static str,
}

impl NodeOutput {
    pub fn new(node: &'static str, out: Tensor) -> Self {
        NodeOutput { out: Mutex::new(Some(out)), node }
    }

    /// The output's storage (a copy: the node's forward returns an owned storage) and shape.
    fn take(&self) -> candle_core::Result<(Storage, Shape)> {
        let error = |what: &str| candle_core::Error::Msg(format!("{}: {what}", self.node));
        let out = self.out.lock().expect("not poisoned").take().ok_or_else(|| error("the output was taken"))?;
        // A fresh product or copy: its storage holds exactly its elements, from the start.
        let (storage, layout) = out.storage_and_layout();
        if layout.contiguous_offsets() != Some((0, out.elem_count())) {
            return Err(error("the output is not a contiguous storage"));
        }
        let storage = match &*storage {
            Storage::Cpu(s) => Storage::Cpu(s.try_clone(layout)?),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Storage::Cuda(s.try_clone(layout)?),
            _ => return Err(error("CPU or CUDA only")),
        };
        Ok((storage, out.shape().clone()))
    }

    /// The node's `cpu_fwd`.
    pub fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.take()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => Err(candle_core::Error::Msg(format!("{}: the output is not on the CPU", self.node))),
        }
    }

    /// The node's `cuda_fwd`.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        match self.take()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => Err(candle_core::Error::Msg(format!("{}: the output is not on the GPU", self.node))),
        }
    }
}

/// The `cpu_fwd` and `cuda_fwd` of a node whose output is its `out` field ([`NodeOutput`]), for
/// the inputs named in pairs (storage, layout): `forward_from_out!(s1 l1, s2 l2);` in the
/// node's `CustomOp2` impl.
macro_rules! forward_from_out {
    ($($s:ident $l:ident),+) => {
        fn cpu_fwd(
            &self,
            $($s: &candle_core::CpuStorage, $l: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            let _ = ($($s, $l),+);
            self.out.cpu()
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            $($s: &candle_core::cuda_backend::CudaStorage, $l: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, candle_core::Shape)> {
            let _ = ($($s, $l),+);
            self.out.cuda()
        }
    };
}
pub(crate) use forward_from_out;

/// A second output of a CUDA op: its `cuda_fwd` puts the storage, the caller takes it as a tensor
/// once the op has run.
#[derive(Default)]
pub(crate) struct SideOutput {
    #[cfg(feature = "cuda")]
    storage: Mutex<Option<candle_core::cuda_backend::CudaStorage>>,
}

impl SideOutput {
    #[cfg(feature = "cuda")]
    pub fn put(&self, storage: candle_core::cuda_backend::CudaStorage) {
        *self.storage.lock().expect("not poisoned") = Some(storage);
    }

    /// The output, of `shape`; an error naming `op` when it ran nowhere that puts it.
    pub fn take(&self, op: &str, shape: impl Into<Shape>) -> crate::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(storage) = self.storage.lock().expect("not poisoned").take() {
            let none = candle_core::op::BackpropOp::none();
            return Ok(Tensor::from_storage(Storage::Cuda(storage), shape.into(), none, false));
        }
        let _ = shape;
        Err(crate::Error::Other(format!("{op}: no second output (the op runs on CUDA only)")))
    }
}
