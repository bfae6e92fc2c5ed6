//! The candle side of the fused ops, written once.
//!
//! Every op is a [`FusedOp`] of N inputs (2 or 3): its name, its CPU kernel generic over the
//! float type, its CUDA kernel generic over the element type (`--features cuda`) and its
//! backward, each given its inputs as arrays. [`Op`] makes it a candle `CustomOp2` or
//! `CustomOp3`: it picks the kernel's type from the first input's dtype (f32 or f64 on the CPU;
//! f32, bf16 or f16 on CUDA; anything else is an error), wraps the kernel's output as a storage,
//! and passes the backward's gradients on. The op files hold only their math and launches.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::{cudarc::driver::CudaSlice, CudaStorage};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor, WithDType};

#[cfg(feature = "cuda")]
use super::cuda;
use super::{data, dispatch_real, Real};

/// One input of a kernel: candle's storage of it and its layout. The wrappers make the inputs
/// contiguous, except where an op reads a layout's strides itself.
pub(crate) struct Input<'a, S> {
    pub storage: &'a S,
    pub layout: &'a Layout,
}

impl<S> Clone for Input<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for Input<'_, S> {}

impl<'a, S> Input<'a, S> {
    fn new(storage: &'a S, layout: &'a Layout) -> Self {
        Input { storage, layout }
    }

    pub fn dims(&self) -> &'a [usize] {
        self.layout.dims()
    }

    pub fn shape(&self) -> &'a Shape {
        self.layout.shape()
    }
}

/// An input on the CPU.
pub(crate) type Cpu<'a> = Input<'a, CpuStorage>;

impl<'a> Cpu<'a> {
    /// The contiguous data, as T (an error for another dtype, or a strided layout).
    pub fn data<T: WithDType>(&self) -> candle_core::Result<&'a [T]> {
        data(self.storage, self.layout)
    }
}

/// An input on a GPU.
#[cfg(feature = "cuda")]
pub(crate) type Cuda<'a> = Input<'a, CudaStorage>;

#[cfg(feature = "cuda")]
impl<'a> Cuda<'a> {
    /// The contiguous data (from the layout's start offset), as T.
    pub fn view<T: candle_core::cuda_backend::CudaDType>(
        &self,
    ) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
        cuda::view(self.storage, self.layout)
    }
}

/// A fused op of N inputs; [`Op`] runs it as a candle custom op.
pub(crate) trait FusedOp<const N: usize> {
    fn name(&self) -> &'static str;

    /// The output and its shape on the CPU, T being the first input's dtype (f32 or f64).
    fn cpu<T: Real>(&self, inputs: [Cpu<'_>; N]) -> candle_core::Result<(Vec<T>, Shape)>;

    /// The output and its shape on a GPU, T being the first input's dtype (f32, bf16 or f16).
    #[cfg(feature = "cuda")]
    fn cuda<T: cuda::Elem>(&self, inputs: [Cuda<'_>; N]) -> candle_core::Result<(CudaSlice<T>, Shape)> {
        let _ = inputs;
        Err(candle_core::Error::Cuda(format!("no cuda implementation for {}", self.name()).into()))
    }

    /// The gradients of the inputs (None for one outside the graph, see [`grad_for`]) from the
    /// inputs, the output `res` and its gradient. None by default: a backward through the op
    /// fails loudly (candle's `BackwardNotSupported`).
    fn bwd(&self, inputs: [&Tensor; N], res: &Tensor, grad: &Tensor) -> candle_core::Result<[Option<Tensor>; N]> {
        let _ = (inputs, res, grad);
        Err(candle_core::Error::BackwardNotSupported { op: self.name() })
    }
}

/// A [`FusedOp`] as a candle `CustomOp2` or `CustomOp3`: `x.apply_op2(&w, Op(RmsNorm { eps }))`.
pub(crate) struct Op<K>(pub K);

/// Runs the CPU kernel in the first input's float type.
fn cpu<K: FusedOp<N>, const N: usize>(op: &K, inputs: [Cpu<'_>; N]) -> candle_core::Result<(CpuStorage, Shape)> {
    dispatch_real!(inputs[0].storage, T => {
        let (out, shape) = op.cpu::<T>(inputs)?;
        Ok((T::to_cpu_storage_owned(out), shape))
    })
}

/// Runs the CUDA kernel in the first input's element type.
#[cfg(feature = "cuda")]
fn cuda<K: FusedOp<N>, const N: usize>(op: &K, inputs: [Cuda<'_>; N]) -> candle_core::Result<(CudaStorage, Shape)> {
    let first = inputs[0].storage;
    cuda::dispatch_cuda!(first, T => {
        let (out, shape) = op.cuda::<T>(inputs)?;
        Ok((cuda::storage(first, out), shape))
    })
}

impl<K: FusedOp<2>> CustomOp2 for Op<K> {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu(&self.0, [Input::new(s1, l1), Input::new(s2, l2)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        cuda(&self.0, [Input::new(s1, l1), Input::new(s2, l2)])
    }

    fn bwd(
        &self,
        a1: &Tensor,
        a2: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let [g1, g2] = self.0.bwd([a1, a2], res, grad)?;
        Ok((g1, g2))
    }
}

impl<K: FusedOp<3>> CustomOp3 for Op<K> {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu(&self.0, [Input::new(s1, l1), Input::new(s2, l2), Input::new(s3, l3)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        cuda(&self.0, [Input::new(s1, l1), Input::new(s2, l2), Input::new(s3, l3)])
    }

    fn bwd(
        &self,
        a1: &Tensor,
        a2: &Tensor,
        a3: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [g1, g2, g3] = self.0.bwd([a1, a2, a3], res, grad)?;
        Ok((g1, g2, g3))
    }
}

/// A backward's gradient for `arg`, or None when `arg` is not part of the graph (a frozen
/// weight): candle would otherwise store a gradient for it under its own id.
pub(crate) fn grad_for(arg: &Tensor, grad: Tensor) -> Option<Tensor> {
    arg.track_op().then_some(grad)
}

/// The `cpu_fwd` of an op whose kernel runs on CUDA only (its callers take another path
/// elsewhere): an error naming the op. `cpu_refused!(N)` in a `CustomOpN` impl (N = 1, 2, 3),
/// `cpu_refused!(inplace N)` in an `InplaceOpN` impl (N = 2, 3).
macro_rules! cpu_refused {
    (@error $self:ident) => {
        Err(candle_core::Error::Msg(format!("{}: the kernel runs on CUDA only", $self.name())))
    };
    (1) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $crate::model::ops::custom_op::cpu_refused!(@error self)
        }
    };
    (2) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $crate::model::ops::custom_op::cpu_refused!(@error self)
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $crate::model::ops::custom_op::cpu_refused!(@error self)
        }
    };
    (inplace 2) => {
        fn cpu_fwd(
            &self,
            _: &mut candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<()> {
            $crate::model::ops::custom_op::cpu_refused!(@error self)
        }
    };
    (inplace 3) => {
        fn cpu_fwd(
            &self,
            _: &mut candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<()> {
            $crate::model::ops::custom_op::cpu_refused!(@error self)
        }
    };
}
pub(crate) use cpu_refused;
