//! A group of workers for one model over a mesh, each worker an [`Actor`] on its own thread.
//!
//! Every call is submitted as one job to each rank and returns a [`Handle`] at once; the handle
//! completes when the last rank has answered. A lock held while the jobs are queued keeps the
//! order of calls identical on every rank (their collectives must match), so calls on one model
//! run in submission order whoever submits them. `mesh` calls (forward_backward, forward) pad
//! and split the batch ([`super::split`]), hand chunk i to the ranks with dp rank i, and keep
//! only what the collection ranks return: their records concatenated in dp order without the
//! padding, their metrics merged once. The other calls (optimizer step, checkpoints, weights,
//! placement) run the same job everywhere. The optimizer step all-reduces the gradients with
//! SUM over each data-parallel group (ranks sharing tp/sp/pp coordinates) before AdamW, so
//! every replica applies the same update. Staged mini-batches are split and stored on the ranks
//! ahead of time and then trained by index through the very same code path as a direct call.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use super::collective::{Collective, InProcess};
use super::mesh::{MeshCoord, MeshInfo, MeshRegistry, MeshShape};
use super::residency::Parts;
use super::split::{merge_outputs, pad_and_split};
use crate::actor::{fan_out, Actor, ActorState};
use crate::algo::{Loss, Metrics};
use crate::handle::Handle;
use crate::locks::lock;
use crate::model::SamplerWeights;
use crate::worker::placement::HostCopy;
use crate::worker::{AdamParams, Datum, ForwardBackwardOutput, RankExchange, ShardPlan, Sharding, Worker};
use crate::world::{decode, encode};
use crate::{Error, Result};

/// Everything one rank's thread owns.
pub struct RankState {
    pub worker: Worker,
    pub info: MeshInfo,
    pub registry: MeshRegistry,
    /// Staged chunks by mini-batch index.
    staged: BTreeMap<usize, Vec<Datum>>,
    /// All-reduce over this rank's data-parallel group.
    collective: Arc<dyn Collective>,
    /// This rank's place among its group's ranks in this process (its collective's rank).
    local_rank: usize,
    host: HostCopy,
}

impl ActorState for RankState {}

/// Builds the worker of a rank from its mesh coordinate (called on that rank's thread, inside
/// its thread budget).
pub type BuildWorker = Arc<dyn Fn(MeshCoord) -> Result<Worker> + Send + Sync>;

pub struct WorkerGroup {
    id: String,
    shape: MeshShape,
    /// Processes the mesh is spread over (1: every rank is a thread here).
    processes: usize,
    ranks: Vec<Actor<RankState>>,
    /// Held while a call is queued on every rank: all ranks see the calls in one order.
    order: Mutex<()>,
    /// Real datum count of each staged mini-batch.
    staged_real: Mutex<BTreeMap<usize, usize>>,
    /// The ranks split the optimizer state ([`crate::worker::Sharding`]).
    sharded: bool,
}

/// A rank's side of its data-parallel group's collective, as a sharded worker needs it.
struct GroupExchange {
    collective: Arc<dyn Collective>,
    rank: usize,
}

impl GroupExchange {
    fn of(s: &RankState) -> Self {
        GroupExchange { collective: s.collective.clone(), rank: s.local_rank }
    }
}

impl RankExchange for GroupExchange {
    fn all_reduce(&self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.collective.all_reduce_sum(self.rank, tensors)
    }

    fn reduce_to_owners(&self, tensors: Vec<Tensor>, owners: &[usize]) -> Result<Vec<Option<Tensor>>> {
        self.collective.reduce_to_owners(self.rank, tensors, owners)
    }

    fn gather_owned(
        &self,
        mine: Vec<Option<Tensor>>,
        sizes: &[usize],
        root: Option<usize>,
    ) -> Result<Vec<Option<Tensor>>> {
        self.collective.gather_owned(self.rank, mine, sizes, root)
    }

    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.collective.all_gather_bytes(self.rank, bytes)
    }

    fn gathers_alone(&self) -> bool {
        self.collective.gathers_alone()
    }

    fn abort(&self, reason: &str) {
        self.collective.abort(reason);
    }
}

/// Handles that every rank waits for: the first rank to arrive waits, the others find them done.
struct Barrier {
    pending: Mutex<Vec<Handle<()>>>,
    failed: Mutex<Option<String>>,
}

impl Barrier {
    fn wait(&self) -> Result<()> {
        let mut pending = lock(&self.pending);
        for h in pending.drain(..) {
            if let Err(e) = h.wait() {
                lock(&self.failed).get_or_insert(e.to_string());
            }
        }
        drop(pending);
        match lock(&self.failed).clone() {
            Some(e) => Err(Error::Other(format!("a move this call waited for failed: {e}"))),
            None => Ok(()),
        }
    }
}

/// A weight-0 copy of a datum: contributes nothing to any loss, gradient or token count.
pub fn padding_datum(d: &Datum) -> Datum {
    let mut p = d.clone();
    p.loss_fn_inputs.weights = Some(vec![0.0; d.input_tokens.len()]);
    p
}

/// Keeps the collection ranks' outputs: records in dp order without padding, metrics merged.
fn collect(per_rank: Vec<(MeshInfo, ForwardBackwardOutput)>, real: usize) -> ForwardBackwardOutput {
    let mut by_dp: BTreeMap<usize, ForwardBackwardOutput> = BTreeMap::new();
    for (info, out) in per_rank {
        if info.collect {
            by_dp.insert(info.dp_rank, out);
        }
    }
    let mut metrics = Metrics::new();
    let mut records = vec![];
    for (_, out) in by_dp {
        metrics.merge(&out.metrics);
        records.push(out.loss_fn_outputs);
    }
    ForwardBackwardOutput { metrics, loss_fn_outputs: merge_outputs(records, real) }
}

/// The dp ranks process `process` of `processes` holds: an equal, contiguous share (the whole
/// mesh in a world of one). Across processes only pure data parallelism is supported.
fn local_dp_ranks(shape: &MeshShape, process: usize, processes: usize) -> Result<std::ops::Range<usize>> {
    if processes == 1 {
        return Ok(0..shape.dp);
    }
    if (shape.tp, shape.sp, shape.pp) != (1, 1, 1) || !shape.dp.is_multiple_of(processes) {
        return Err(Error::input(format!(
            "a mesh over {processes} processes must be pure data parallelism with dp a multiple of {processes} \
             (got dp {}, tp {}, sp {}, pp {})",
            shape.dp, shape.tp, shape.sp, shape.pp
        )));
    }
    let per = shape.dp / processes;
    Ok(process * per..(process + 1) * per)
}

/// Which pass a mesh call runs on each rank's chunk.
#[derive(Clone, Copy)]
enum Pass {
    Forward,
    Backward,
    /// A backward whose gradients the next call's optimizer step applies.
    BackwardForStep,
}

impl WorkerGroup {
    /// Starts one actor per mesh coordinate, each with `threads` tensor-math threads (0: one
    /// per core), and builds its worker there.
    pub fn new(id: &str, shape: MeshShape, threads: usize, build: BuildWorker) -> Result<Self> {
        shape.validate()?;
        let world = crate::world::world()?;
        let local = local_dp_ranks(&shape, world.rank(), world.size())?;
        let first_local = local.start;
        // One collective per data-parallel group: ranks with the same (tp, sp, pp).
        let mut collectives: BTreeMap<(usize, usize, usize), Arc<dyn Collective>> = BTreeMap::new();
        let mut ranks = vec![];
        // Set by the ranks' builds (which `Actor::spawn` waits for) when the workers shard.
        let sharded = Arc::new(AtomicBool::new(false));
        for (i, coord) in shape.coords().into_iter().enumerate().filter(|(_, c)| local.contains(&c.dp)) {
            let collective = collectives
                .entry((coord.tp, coord.sp, coord.pp))
                .or_insert_with(|| Arc::new(InProcess::across(local.len(), world)) as Arc<dyn Collective>)
                .clone();
            let (build, mesh_name, sharded) = (build.clone(), id.to_string(), sharded.clone());
            let actor = Actor::spawn(&format!("oxrl-{id}-{i}"), threads, move || {
                let mut worker = build(coord)?;
                let mode = worker.config().sharding;
                let local_rank = coord.dp - first_local;
                // Over the data-parallel group: the ranks sharing this rank's (tp, sp, pp).
                let ex: Arc<dyn RankExchange> =
                    Arc::new(GroupExchange { collective: collective.clone(), rank: local_rank });
                worker.join_group(ex.clone());
                if mode.is_sharded() {
                    sharded.store(true, Ordering::Relaxed);
                    let plan = ShardPlan::new(mode, coord.dp, shape.dp, &worker.param_sizes());
                    match mode {
                        Sharding::Full => worker.shard_full(plan, ex)?,
                        _ => worker.shard(plan)?,
                    }
                }
                let mut registry = MeshRegistry::default();
                let info = registry.register(&mesh_name, &shape, coord)?;
                Ok(RankState {
                    worker,
                    info,
                    registry,
                    staged: BTreeMap::new(),
                    collective,
                    local_rank,
                    host: HostCopy::default(),
                })
            })
            .map_err(|e| Error::Other(format!("model `{id}`, rank {i}: {e}")))?;
            ranks.push(actor);
        }
        Ok(WorkerGroup {
            id: id.to_string(),
            shape,
            processes: world.size(),
            ranks,
            order: Mutex::new(()),
            staged_real: Mutex::new(BTreeMap::new()),
            sharded: sharded.load(Ordering::Relaxed),
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn mesh(&self) -> MeshShape {
        self.shape
    }

    pub fn dp_size(&self) -> usize {
        self.shape.dp
    }

    /// Runs `f` on every rank, behind the calls already submitted; the handle yields
    /// `combine(results in rank order)` (or the first error).
    pub fn submit_each<R: Send + 'static, T: Send + 'static>(
        &self,
        f: impl Fn(&mut RankState) -> Result<R> + Send + Sync + 'static,
        combine: impl FnOnce(Vec<R>) -> Result<T> + Send + 'static,
    ) -> Handle<T> {
        let _order = lock(&self.order);
        fan_out(&self.ranks, move |_, s| f(s), combine)
    }

    /// [`WorkerGroup::submit_each`] for calls that return nothing.
    fn submit_unit(&self, f: impl Fn(&mut RankState) -> Result<()> + Send + Sync + 'static) -> Handle<()> {
        self.submit_each(f, |_| Ok(()))
    }

    /// Runs `f` on every rank and keeps the collection ranks' outputs (`real` datums). Across
    /// processes, each rank gathers every rank's output on its own thread, in call order (so
    /// the gathers of successive calls never cross), and the local ranks' copies agree.
    fn submit_collected(
        &self,
        real: usize,
        f: impl Fn(&mut RankState) -> Result<ForwardBackwardOutput> + Send + Sync + 'static,
    ) -> Handle<ForwardBackwardOutput> {
        let across = self.processes > 1;
        self.submit_each(
            move |s| {
                let out = f(s);
                if !across {
                    return Ok(vec![(s.info, out?)]);
                }
                // Every rank must reach the gather, also after an error (it carries the error).
                let mine: std::result::Result<(usize, bool, &ForwardBackwardOutput), String> =
                    out.as_ref().map(|o| (s.info.dp_rank, s.info.collect, o)).map_err(|e| e.to_string());
                let all = s.collective.all_gather_bytes(s.local_rank, encode(&mine)?)?;
                out?;
                all.iter()
                    .enumerate()
                    .map(|(rank, bytes)| {
                        let theirs: std::result::Result<(usize, bool, ForwardBackwardOutput), String> = decode(bytes)?;
                        let (dp_rank, collect, out) =
                            theirs.map_err(|e| Error::Other(format!("dp rank {rank} failed: {e}")))?;
                        Ok((MeshInfo { dp_rank, collect, ..s.info }, out))
                    })
                    .collect()
            },
            move |per_rank: Vec<Vec<(MeshInfo, ForwardBackwardOutput)>>| {
                Ok(collect(per_rank.into_iter().flatten().collect(), real))
            },
        )
    }

    /// `mesh` dispatch of forward_backward (a plain-sum gradient added on every rank).
    pub fn submit_forward_backward(
        &self,
        batch: &[Datum],
        loss: Option<&Loss>,
        per_token: bool,
    ) -> Handle<ForwardBackwardOutput> {
        self.submit_mesh(batch, loss, per_token, Pass::Backward)
    }

    /// [`WorkerGroup::submit_forward_backward`] whose gradients the next call, the optimizer
    /// step, applies ([`Worker::forward_backward_for_step`]).
    pub fn submit_forward_backward_for_step(
        &self,
        batch: &[Datum],
        loss: Option<&Loss>,
        per_token: bool,
    ) -> Handle<ForwardBackwardOutput> {
        self.submit_mesh(batch, loss, per_token, Pass::BackwardForStep)
    }

    /// `mesh` dispatch of forward (no gradients); the same arguments as forward_backward.
    pub fn submit_forward(
        &self,
        batch: &[Datum],
        loss: Option<&Loss>,
        per_token: bool,
    ) -> Handle<ForwardBackwardOutput> {
        self.submit_mesh(batch, loss, per_token, Pass::Forward)
    }

    fn submit_mesh(
        &self,
        batch: &[Datum],
        loss: Option<&Loss>,
        per_token: bool,
        pass: Pass,
    ) -> Handle<ForwardBackwardOutput> {
        let split = match pad_and_split(batch, self.shape.dp, padding_datum) {
            Ok(s) => s,
            Err(e) => return Handle::ready(Err(e)),
        };
        let chunks = Arc::new(split.chunks);
        let loss = loss.cloned();
        self.submit_collected(split.real, move |s| {
            let chunk = &chunks[s.info.dp_rank];
            match pass {
                Pass::Forward => s.worker.forward(chunk, loss.as_ref(), per_token),
                Pass::Backward => s.worker.forward_backward(chunk, loss.as_ref(), per_token),
                Pass::BackwardForStep => s.worker.forward_backward_for_step(chunk, loss.as_ref(), per_token),
            }
        })
    }

    /// Places the mini-batches of a step on the ranks ahead of time (replacing earlier ones).
    pub fn stage(&self, minibatches: &[Vec<Datum>]) -> Handle<()> {
        let mut per_index = vec![];
        let mut real = BTreeMap::new();
        for (i, mb) in minibatches.iter().enumerate() {
            match pad_and_split(mb, self.shape.dp, padding_datum) {
                Ok(split) => {
                    real.insert(i, split.real);
                    per_index.push(split.chunks);
                }
                Err(e) => return Handle::ready(Err(Error::input(format!("staged mini-batch {i}: {e}")))),
            }
        }
        *lock(&self.staged_real) = real;
        let per_index = Arc::new(per_index);
        self.submit_unit(move |s| {
            s.staged = per_index.iter().enumerate().map(|(i, chunks)| (i, chunks[s.info.dp_rank].clone())).collect();
            Ok(())
        })
    }

    /// forward_backward on a staged mini-batch; returns exactly what the direct call returns.
    pub fn submit_forward_backward_staged(
        &self,
        index: usize,
        loss: &Loss,
        per_token: bool,
    ) -> Handle<ForwardBackwardOutput> {
        let staged = lock(&self.staged_real).get(&index).copied();
        let Some(real) = staged else {
            let n = lock(&self.staged_real).len();
            return Handle::ready(Err(Error::input(format!(
                "staged mini-batch index {index} is out of range ({n} staged)"
            ))));
        };
        let loss = loss.clone();
        self.submit_collected(real, move |s| {
            let chunk = s
                .staged
                .get(&index)
                .ok_or_else(|| Error::input(format!("staged mini-batch {index} missing on a rank")))?;
            s.worker.forward_backward(chunk, Some(&loss), per_token)
        })
    }

    /// All-reduces gradients (SUM over dp) and applies AdamW on every rank — or, sharded, each
    /// rank updates the parameters it owns and the group gathers them; the handle yields the
    /// pre-clip global gradient norm.
    pub fn submit_optim_step(&self, params: AdamParams) -> Handle<f64> {
        self.submit_each(
            move |s| {
                let (collective, rank) = (s.collective.clone(), s.local_rank);
                let stepped = if s.worker.shard_plan().is_some() {
                    let ex = GroupExchange::of(s);
                    s.worker.optim_step_sharded(&params, &ex)
                } else {
                    s.worker
                        .reduce_gradients(|g| collective.all_reduce_sum(rank, g))
                        .and_then(|_| s.worker.optim_step(&params))
                };
                if let Err(e) = &stepped {
                    s.collective.abort(&format!("rank {rank}: {e}"));
                }
                stepped
            },
            |norms: Vec<f64>| Ok(norms[0]),
        )
    }

    /// Runs `f` on the first collection rank of this process's first dp rank (dp rank 0 in a
    /// world of one; every replica holds the same state).
    fn submit_on_rank0<R: Send + 'static>(
        &self,
        f: impl Fn(&mut RankState) -> Result<R> + Send + Sync + 'static,
    ) -> Handle<R> {
        self.submit_each(
            move |s| if s.local_rank == 0 && s.info.collect { f(s).map(Some) } else { Ok(None) },
            |results: Vec<Option<R>>| {
                results
                    .into_iter()
                    .flatten()
                    .next()
                    .ok_or_else(|| Error::Other("no collection rank at dp rank 0".into()))
            },
        )
    }

    /// Writes the training state (from dp rank 0; sharded, every rank sends its slice of the
    /// optimizer state there first).
    pub fn submit_save_state(&self, dir: &Path) -> Handle<()> {
        let dir = dir.to_path_buf();
        if self.sharded {
            let write = crate::world::is_writer();
            return self.submit_unit(move |s| {
                let ex = GroupExchange::of(s);
                s.worker.save_state_sharded(&dir, write && s.info.collect, &ex)
            });
        }
        if !crate::world::is_writer() {
            return Handle::ready(Ok(())); // process 0 writes the checkpoint
        }
        self.submit_on_rank0(move |s| s.worker.save_state(&dir))
    }

    /// Loads a training state into every rank.
    pub fn submit_load_state(&self, dir: &Path) -> Handle<()> {
        let dir = dir.to_path_buf();
        self.submit_unit(move |s| s.worker.load_state(&dir))
    }

    /// Loads only the parameters of a training state into every rank (fresh optimizer).
    pub fn submit_load_weights(&self, dir: &Path) -> Handle<()> {
        let dir = dir.to_path_buf();
        self.submit_unit(move |s| s.worker.load_weights(&dir))
    }

    /// Exports the model (HF layout, or PEFT for LoRA) from dp rank 0.
    pub fn submit_export(&self, dir: &Path, merge_lora: bool) -> Handle<()> {
        if self.sharded {
            // `full` keeps slices of the weights: every rank takes part in gathering them.
            let (dir, write) = (dir.to_path_buf(), crate::world::is_writer());
            return self.submit_unit(move |s| {
                let here = write && s.local_rank == 0 && s.info.collect;
                if s.worker.config().lora.is_some() && !merge_lora {
                    // The adapters alone, which every rank holds whole.
                    return if here { s.worker.export(&dir, false) } else { Ok(()) };
                }
                s.worker.with_whole_weights(here, |w| w.export(&dir, merge_lora))
            });
        }
        if !crate::world::is_writer() {
            return Handle::ready(Ok(())); // process 0 writes the export
        }
        let dir: PathBuf = dir.to_path_buf();
        self.submit_on_rank0(move |s| s.worker.export(&dir, merge_lora))
    }

    /// A private, versioned snapshot of the weights the sampling engines need (full weights by
    /// HF name, or only the LoRA adapters), taken behind the calls already submitted.
    pub fn submit_sampler_weights(&self) -> Handle<SamplerWeights> {
        if self.sharded {
            // Under `full` every rank sends its slice to the snapshot.
            return self.submit_each(
                |s| s.worker.sampler_weights_gathered(s.local_rank == 0 && s.info.collect),
                |all: Vec<Option<SamplerWeights>>| {
                    all.into_iter()
                        .flatten()
                        .next()
                        .ok_or_else(|| Error::Other("no collection rank at dp rank 0".into()))
                },
            );
        }
        self.submit_on_rank0(|s| s.worker.sampler_weights())
    }

    pub fn submit_offload(&self, parts: Parts) -> Handle<()> {
        self.submit_unit(move |s| s.worker.offload(parts.model, parts.optimizer, &mut s.host))
    }

    pub fn submit_backload(&self, parts: Parts) -> Handle<()> {
        self.submit_unit(move |s| s.worker.backload(parts.model, parts.optimizer, &mut s.host))
    }

    /// Queues a barrier: calls submitted after it start once every handle in `after` has
    /// completed (how a colocated model waits for the other models' offloads). Its own handle
    /// carries their first error.
    pub fn submit_barrier(&self, after: Vec<Handle<()>>) -> Handle<()> {
        let barrier = Arc::new(Barrier { pending: Mutex::new(after), failed: Mutex::new(None) });
        self.submit_unit(move |_| barrier.wait())
    }

    /// Reads something off every rank's worker, behind the calls already submitted (tests,
    /// metrics). Blocks.
    pub fn inspect<R: Send + 'static>(&self, f: impl Fn(&Worker) -> R + Send + Sync + 'static) -> Result<Vec<R>> {
        self.submit_each(move |s| Ok(f(&s.worker)), Ok).wait()
    }
}
