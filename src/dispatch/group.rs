//! A group of workers for one role over a mesh, each worker on its own thread.
//!
//! Every call is a job sent to each rank's thread; replies come back in rank order. `mesh`
//! calls ([`WorkerGroup::forward_backward`], [`WorkerGroup::forward`]) pad and split the batch
//! ([`super::split`]), hand chunk i to the ranks with dp rank i, and keep only what the
//! collection ranks return: their records concatenated in dp order without the padding, their
//! metrics merged once. `pass_through` calls (optimizer step, checkpoints, placement) run the
//! same job everywhere. The optimizer step all-reduces the gradients with SUM over each
//! data-parallel group (ranks sharing tp/sp/pp coordinates) before AdamW, so every replica
//! applies the same update. Staged mini-batches are split and stored on the ranks ahead of
//! time and then trained by index through the very same code path as a direct call.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use serde_json::Value;

use super::collective::{Collective, InProcess};
use super::mesh::{MeshCoord, MeshInfo, MeshRegistry, MeshShape};
use super::residency::Parts;
use super::split::{merge_outputs, pad_and_split};
use super::Role;
use crate::algo::Metrics;
use crate::worker::placement::HostCopy;
use crate::worker::{AdamParams, Datum, ForwardBackwardOutput, Worker};
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
    host: HostCopy,
}

type Job = Box<dyn FnOnce(&mut RankState) + Send>;

struct Rank {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// Builds the worker of a rank from its mesh coordinate (called on that rank's thread).
pub type BuildWorker = Arc<dyn Fn(MeshCoord) -> Result<Worker> + Send + Sync>;

pub struct WorkerGroup {
    role: Role,
    shape: MeshShape,
    ranks: Vec<Rank>,
    /// Real datum count of each staged mini-batch.
    staged_real: BTreeMap<usize, usize>,
}

/// A weight-0 copy of a datum: contributes nothing to any loss, gradient or token count.
pub fn padding_datum(d: &Datum) -> Datum {
    let mut p = d.clone();
    p.loss_fn_inputs.weights = Some(vec![0.0; d.input_tokens.len()]);
    p
}

impl WorkerGroup {
    /// Starts one thread per mesh coordinate and builds its worker there.
    pub fn new(role: Role, shape: MeshShape, build: BuildWorker) -> Result<Self> {
        shape.validate()?;
        // One collective per data-parallel group: ranks with the same (tp, sp, pp).
        let mut collectives: BTreeMap<(usize, usize, usize), Arc<dyn Collective>> = BTreeMap::new();
        let mut ranks = vec![];
        let mut ready = vec![];
        for coord in shape.coords() {
            let collective = collectives
                .entry((coord.tp, coord.sp, coord.pp))
                .or_insert_with(|| Arc::new(InProcess::new(shape.dp)) as Arc<dyn Collective>)
                .clone();
            let (tx, rx) = channel::<Job>();
            let (ready_tx, ready_rx) = channel::<Result<()>>();
            let build = build.clone();
            let mesh_name = format!("{role:?}").to_lowercase();
            let thread = std::thread::Builder::new()
                .name(format!("oxrl-{mesh_name}-{}", ranks.len()))
                .spawn(move || {
                    let mut registry = MeshRegistry::default();
                    let made = build(coord).and_then(|w| Ok((w, registry.register(&mesh_name, &shape, coord)?)));
                    let (worker, info) = match made {
                        Ok(x) => {
                            let _ = ready_tx.send(Ok(()));
                            x
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let mut state = RankState {
                        worker,
                        info,
                        registry,
                        staged: BTreeMap::new(),
                        collective,
                        host: HostCopy::default(),
                    };
                    while let Ok(job) = rx.recv() {
                        job(&mut state);
                    }
                })
                .map_err(|e| Error::Other(format!("cannot start a worker thread: {e}")))?;
            ranks.push(Rank { tx: Some(tx), thread: Some(thread) });
            ready.push(ready_rx);
        }
        for (i, r) in ready.into_iter().enumerate() {
            r.recv().map_err(|_| Error::Other(format!("{role:?} rank {i} died while starting")))??;
        }
        Ok(WorkerGroup { role, shape, ranks, staged_real: BTreeMap::new() })
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn mesh(&self) -> MeshShape {
        self.shape
    }

    pub fn dp_size(&self) -> usize {
        self.shape.dp
    }

    /// Runs `f` on every rank concurrently; results in rank order, or the first error.
    pub fn on_all<R: Send + 'static>(
        &self,
        f: impl Fn(&mut RankState) -> Result<R> + Send + Sync + 'static,
    ) -> Result<Vec<R>> {
        let f = Arc::new(f);
        let mut replies = vec![];
        for (i, rank) in self.ranks.iter().enumerate() {
            let (tx, rx) = channel();
            let f = f.clone();
            let job: Job = Box::new(move |s: &mut RankState| {
                let _ = tx.send(f(s));
            });
            rank.tx
                .as_ref()
                .expect("sender lives as long as the group")
                .send(job)
                .map_err(|_| Error::Other(format!("{:?} rank {i} has stopped", self.role)))?;
            replies.push(rx);
        }
        let mut out = Vec::with_capacity(replies.len());
        let mut first_err = None;
        for (i, rx) in replies.into_iter().enumerate() {
            match rx.recv() {
                Ok(Ok(r)) => out.push(r),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(Error::Other(format!("{:?} rank {i} panicked", self.role)));
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Keeps the collection ranks' outputs: records in dp order without padding, metrics merged.
    fn collect(&self, per_rank: Vec<(MeshInfo, ForwardBackwardOutput)>, real: usize) -> ForwardBackwardOutput {
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

    /// `mesh` dispatch of forward_backward.
    pub fn forward_backward(
        &self,
        batch: &[Datum],
        loss_fn: &str,
        config: &Value,
        per_token: bool,
    ) -> Result<ForwardBackwardOutput> {
        let split = pad_and_split(batch, self.shape.dp, padding_datum)?;
        let chunks = Arc::new(split.chunks);
        let (name, config) = (loss_fn.to_string(), config.clone());
        let out = self.on_all(move |s| {
            let out = s.worker.forward_backward(&chunks[s.info.dp_rank], &name, &config, per_token)?;
            Ok((s.info, out))
        })?;
        Ok(self.collect(out, split.real))
    }

    /// `mesh` dispatch of forward (no gradients).
    pub fn forward(&self, batch: &[Datum], loss_fn: Option<(&str, &Value)>) -> Result<ForwardBackwardOutput> {
        let split = pad_and_split(batch, self.shape.dp, padding_datum)?;
        let chunks = Arc::new(split.chunks);
        let loss = loss_fn.map(|(n, c)| (n.to_string(), c.clone()));
        let out = self.on_all(move |s| {
            let l = loss.as_ref().map(|(n, c)| (n.as_str(), c));
            Ok((s.info, s.worker.forward(&chunks[s.info.dp_rank], l)?))
        })?;
        Ok(self.collect(out, split.real))
    }

    /// Places the mini-batches of a step on the ranks ahead of time (replacing earlier ones).
    pub fn stage(&mut self, minibatches: &[Vec<Datum>]) -> Result<()> {
        let mut per_index = vec![];
        self.staged_real.clear();
        for (i, mb) in minibatches.iter().enumerate() {
            let split = pad_and_split(mb, self.shape.dp, padding_datum)
                .map_err(|e| Error::input(format!("staged mini-batch {i}: {e}")))?;
            self.staged_real.insert(i, split.real);
            per_index.push(split.chunks);
        }
        let per_index = Arc::new(per_index);
        self.on_all(move |s| {
            s.staged = per_index.iter().enumerate().map(|(i, chunks)| (i, chunks[s.info.dp_rank].clone())).collect();
            Ok(())
        })?;
        Ok(())
    }

    /// forward_backward on a staged mini-batch; returns exactly what the direct call returns.
    pub fn forward_backward_staged(
        &self,
        index: usize,
        loss_fn: &str,
        config: &Value,
        per_token: bool,
    ) -> Result<ForwardBackwardOutput> {
        let real = *self.staged_real.get(&index).ok_or_else(|| {
            Error::input(format!("staged mini-batch index {index} is out of range ({} staged)", self.staged_real.len()))
        })?;
        let (name, config) = (loss_fn.to_string(), config.clone());
        let out = self.on_all(move |s| {
            let chunk = s
                .staged
                .get(&index)
                .ok_or_else(|| Error::input(format!("staged mini-batch {index} missing on a rank")))?;
            Ok((s.info, s.worker.forward_backward(chunk, &name, &config, per_token)?))
        })?;
        Ok(self.collect(out, real))
    }

    /// All-reduces gradients (SUM over dp) and applies AdamW on every rank; returns the
    /// pre-clip global gradient norm.
    pub fn optim_step(&self, params: &AdamParams) -> Result<f64> {
        let params = *params;
        let norms = self.on_all(move |s| {
            let (collective, rank) = (s.collective.clone(), s.info.dp_rank);
            let reduced = s.worker.reduce_gradients(|g| collective.all_reduce_sum(rank, g));
            if let Err(e) = &reduced {
                s.collective.abort(&format!("rank {rank}: {e}"));
            }
            reduced?;
            s.worker.optim_step(&params)
        })?;
        Ok(norms[0])
    }

    /// Writes the state of dp rank 0 (every replica holds the same state).
    pub fn save_state(&self, dir: &std::path::Path) -> Result<()> {
        let dir = dir.to_path_buf();
        self.on_all(move |s| if s.info.dp_rank == 0 && s.info.collect { s.worker.save_state(&dir) } else { Ok(()) })?;
        Ok(())
    }

    pub fn load_state(&self, dir: &std::path::Path) -> Result<()> {
        let dir = dir.to_path_buf();
        self.on_all(move |s| s.worker.load_state(&dir))?;
        Ok(())
    }

    /// Exports the model (HF layout, or PEFT for LoRA) from dp rank 0.
    pub fn export(&self, dir: &std::path::Path, merge_lora: bool) -> Result<()> {
        let dir = dir.to_path_buf();
        self.on_all(
            move |s| if s.info.dp_rank == 0 && s.info.collect { s.worker.export(&dir, merge_lora) } else { Ok(()) },
        )?;
        Ok(())
    }

    pub fn offload(&self, parts: Parts) -> Result<()> {
        self.on_all(move |s| s.worker.offload(parts.model, parts.optimizer, &mut s.host))?;
        Ok(())
    }

    pub fn backload(&self, parts: Parts) -> Result<()> {
        self.on_all(move |s| s.worker.backload(parts.model, parts.optimizer, &mut s.host))?;
        Ok(())
    }

    /// Reads something off every rank's worker (tests, metrics).
    pub fn inspect<R: Send + 'static>(&self, f: impl Fn(&Worker) -> R + Send + Sync + 'static) -> Result<Vec<R>> {
        self.on_all(move |s| Ok(f(&s.worker)))
    }
}

impl Drop for WorkerGroup {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            r.tx.take();
        }
        for r in &mut self.ranks {
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}
