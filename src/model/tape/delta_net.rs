//! A Gated DeltaNet mixer on the tape: its projections ([`super::linear`]) around the layer's
//! slice kernels ([`crate::model::delta_net`], the engine's own), forward and backward.

use super::linear;
use super::{Grads, Held, Shared};
use crate::model::delta_net::{self as kernels, Dims, GatedDeltaNet, Params};
use crate::model::ops::Real;
use crate::model::transformer::Transformer;
use crate::{Error, Result};

/// What the backward reads: the projections' outputs, the kernel's record, the out_proj input.
pub struct TapeRecord<T> {
    qkv: Vec<T>,
    z: Vec<T>,
    a: Vec<T>,
    b: Vec<T>,
    core: kernels::Record<T>,
    out: Vec<T>,
}

/// The layer's non-projection parameters, held as `T`.
struct Held4<'t, T> {
    conv: Held<'t, T>,
    a_log: Held<'t, T>,
    dt_bias: Held<'t, T>,
    norm: Held<'t, T>,
}

impl<'t, T: Real> Held4<'t, T> {
    fn new(dn: &'t GatedDeltaNet) -> Result<Self> {
        Ok(Held4 {
            conv: Held::new(&dn.conv1d)?,
            a_log: Held::new(&dn.a_log)?,
            dt_bias: Held::new(&dn.dt_bias)?,
            norm: Held::new(&dn.norm)?,
        })
    }
    fn params(&self, eps: f64) -> Result<Params<'_, T>> {
        Ok(Params {
            conv: self.conv.slice()?,
            a_log: self.a_log.slice()?,
            dt_bias: self.dt_bias.slice()?,
            norm: self.norm.slice()?,
            eps,
        })
    }
}

fn dims<T>(model: &Transformer, shared: &Shared<T>) -> Result<Dims> {
    let cfg = model.config.delta_net.ok_or_else(|| Error::Other("tape: a DeltaNet layer without its config".into()))?;
    Ok(Dims { b: shared.dims.b, t: shared.dims.t, cfg })
}

/// The mixer's output [B·T, hidden], the adapters' u of its five projections, and the record.
#[allow(clippy::type_complexity)]
pub fn forward<T: Real>(
    model: &Transformer,
    dn: &GatedDeltaNet,
    x: &[T],
    shared: &Shared<T>,
) -> Result<(Vec<T>, Vec<Option<Vec<T>>>, TapeRecord<T>)> {
    let dims = dims(model, shared)?;
    let n = dims.b * dims.t;
    let ((qkv, z), (b, a)) = rayon::join(
        || rayon::join(|| linear::forward(&dn.in_proj_qkv, x, n), || linear::forward(&dn.in_proj_z, x, n)),
        || rayon::join(|| linear::forward(&dn.in_proj_b, x, n), || linear::forward(&dn.in_proj_a, x, n)),
    );
    let ((qkv, uq), (z, uz), (b, ub), (a, ua)) = (qkv?, z?, b?, a?);
    let held = Held4::<T>::new(dn)?;
    let p = held.params(model.config.rms_norm_eps)?;
    let mut state = vec![T::of(0.0); dims.b * kernels::state_len(&dims.cfg)];
    let (out, core) = kernels::forward(&qkv, &z, &a, &b, &p, &shared.mask, &mut state, dims, true);
    let (o, uo) = linear::forward(&dn.out_proj, &out, n)?;
    let core = core.expect("recorded");
    Ok((o, vec![uq, uz, ub, ua, uo], TapeRecord { qkv, z, a, b, core, out }))
}

/// The backward from the gradient of the mixer's output `dh`: the gradient of its input x.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Real>(
    model: &Transformer,
    dn: &GatedDeltaNet,
    rec: &TapeRecord<T>,
    x: &[T],
    u: &[Option<Vec<T>>],
    dh: &[T],
    shared: &Shared<T>,
    grads: &mut Grads<T>,
) -> Result<Vec<T>> {
    let dims = dims(model, shared)?;
    let n = dims.b * dims.t;
    let u = |k: usize| u[k].as_deref();
    let mut d_out = None;
    linear::backward(&dn.out_proj, &rec.out, u(4), dh, n, &mut d_out, grads)?;
    let d_out = d_out.expect("set by the backward");
    let held = Held4::<T>::new(dn)?;
    let p = held.params(model.config.rms_norm_eps)?;
    let g = kernels::backward(&rec.qkv, &rec.z, &rec.a, &rec.b, &p, &rec.core, &d_out, dims);
    for (param, grad) in [(&dn.conv1d, g.conv), (&dn.a_log, g.a_log), (&dn.dt_bias, g.dt_bias), (&dn.norm, g.norm)] {
        if param.is_variable() {
            grads.push(param, grad);
        }
    }
    let mut dx = None;
    linear::backward(&dn.in_proj_qkv, x, u(0), &g.qkv, n, &mut dx, grads)?;
    linear::backward(&dn.in_proj_z, x, u(1), &g.z, n, &mut dx, grads)?;
    linear::backward(&dn.in_proj_b, x, u(2), &g.b, n, &mut dx, grads)?;
    linear::backward(&dn.in_proj_a, x, u(3), &g.a, n, &mut dx, grads)?;
    Ok(dx.expect("set by the backward"))
}
