//! [`Actor`]: a thread that owns some state and runs the jobs sent to it, in order, on its own
//! tensor-math thread budget.
//!
//! Worker ranks and sampling engines are actors. Jobs are closures over the state, queued on a
//! tokio unbounded channel and run one at a time in submission order, so calls on one model
//! never reorder. [`Actor::call`] returns a [`Handle`] at once. An actor with background work
//! (an engine with requests to decode) says so through [`ActorState::has_work`]; between jobs it
//! then runs [`ActorState::work`] (one decode step), and sleeps on the channel otherwise, so an
//! idle actor costs nothing.
//!
//! Thread budget: the job loop runs inside a rayon pool of `threads` threads owned by this
//! actor, and oxrl's CPU kernels (the tape's products, `model::ops`, including
//! [`ops::matmul`](crate::model::ops::matmul), which makes candle's gemm calls) take their thread
//! count from the pool they run in, never from the environment. So an engine given 1 thread and
//! a trainer given 1 thread share two cores without stealing each other's, and the budget is the
//! one given where the actor starts ([`crate::launch`] for runs): a program using the library
//! and the `oxrl` command line run with the same threads. Nothing here sets a process-wide
//! variable. (candle keeps one process-wide pool of its own, for its elementwise ops on tensors
//! of 64 Ki elements and more, sized once from `CANDLE_NUM_THREADS`, else `RAYON_NUM_THREADS`,
//! else the physical cores; splitting those ops does not change their results. The `oxrl`
//! binary sets `CANDLE_NUM_THREADS=1` unless the environment has it, keeping them on the calling
//! thread; a program using the library may do the same.)
//!
//! [`fan_out`] sends one job to each of several actors and completes one handle when the last
//! one finishes — how a worker group speaks to its ranks and the engine client to its engines,
//! without a thread per call.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc;

use crate::handle::{self, Handle, Reply};
use crate::locks::lock;
use crate::{Error, Result};

/// State owned by an actor's thread.
pub trait ActorState: Send + 'static {
    /// Whether background work is pending (then the actor does not sleep between jobs).
    fn has_work(&self) -> bool {
        false
    }
    /// One unit of background work, run between jobs while `has_work`.
    fn work(&mut self) {}
}

type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

pub struct Actor<S> {
    name: String,
    tx: Option<mpsc::UnboundedSender<Job<S>>>,
    thread: Option<JoinHandle<()>>,
}

impl<S: ActorState> Actor<S> {
    /// Starts the thread, builds the state there with `init` (inside the thread budget), and
    /// returns once it is built (or with `init`'s error). `threads` = 0 means rayon's default
    /// (one per core).
    pub fn spawn(name: &str, threads: usize, init: impl FnOnce() -> Result<S> + Send + 'static) -> Result<Self> {
        let mut builder = rayon::ThreadPoolBuilder::new();
        if threads > 0 {
            builder = builder.num_threads(threads);
        }
        let math_name = name.to_string();
        let pool = builder
            .thread_name(move |i| format!("{math_name}-math-{i}"))
            .build()
            .map_err(|e| Error::Other(format!("{name}: cannot build its thread pool: {e}")))?;
        let (tx, rx) = mpsc::unbounded_channel::<Job<S>>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || pool.install(move || run(init, rx, ready_tx)))
            .map_err(|e| Error::Other(format!("{name}: cannot start its thread: {e}")))?;
        let actor = Actor { name: name.to_string(), tx: Some(tx), thread: Some(thread) };
        ready_rx.recv().map_err(|_| Error::Other(format!("{name}: its thread died while starting")))??;
        Ok(actor)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Queues a job; an error if the thread has stopped.
    pub fn post(&self, job: impl FnOnce(&mut S) + Send + 'static) -> Result<()> {
        let tx = self.tx.as_ref().expect("the sender lives as long as the actor");
        tx.send(Box::new(job)).map_err(|_| Error::Other(format!("{} has stopped", self.name)))
    }

    /// Queues `f` and returns the handle of its result.
    pub fn call<R: Send + 'static>(&self, f: impl FnOnce(&mut S) -> Result<R> + Send + 'static) -> Handle<R> {
        let (reply, handle) = handle::channel();
        match self.post(move |s| reply.send(f(s))) {
            Ok(()) => handle,
            Err(e) => Handle::ready(Err(e)),
        }
    }
}

fn run<S: ActorState>(
    init: impl FnOnce() -> Result<S>,
    mut rx: mpsc::UnboundedReceiver<Job<S>>,
    ready: std::sync::mpsc::Sender<Result<()>>,
) {
    let mut state = match init() {
        Ok(s) => {
            let _ = ready.send(Ok(()));
            s
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    loop {
        let job = if state.has_work() {
            match rx.try_recv() {
                Ok(job) => Some(job),
                Err(mpsc::error::TryRecvError::Empty) => None,
                Err(mpsc::error::TryRecvError::Disconnected) => return,
            }
        } else {
            match rx.blocking_recv() {
                Some(job) => Some(job),
                None => return,
            }
        };
        // A panicking job drops its reply (its handle reports an error); the actor carries on.
        let outcome = match job {
            Some(job) => catch_unwind(AssertUnwindSafe(|| {
                crate::failpoint::actor_job();
                job(&mut state)
            })),
            None => catch_unwind(AssertUnwindSafe(|| state.work())),
        };
        if let Err(panic) = outcome {
            let what =
                panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
            eprintln!(
                "{}: a job panicked: {}",
                std::thread::current().name().unwrap_or("actor"),
                what.unwrap_or_default()
            );
        }
    }
}

impl<S> Drop for Actor<S> {
    fn drop(&mut self) {
        // Closing the channel ends the loop once the queued jobs have run.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            // Dropped from its own thread (the last owner was a job of its own): it ends by
            // itself once the channel is drained; joining would wait for ourselves.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// How the results of a fan-out become its answer.
type Combine<R, T> = Box<dyn FnOnce(Vec<R>) -> Result<T> + Send>;

/// Collects one result per actor and answers once all are in.
struct Gather<R, T> {
    results: Vec<Option<Result<R>>>,
    left: usize,
    finish: Option<(Reply<T>, Combine<R, T>)>,
}

impl<R, T> Gather<R, T> {
    /// Stores result `i`; the last one completes the reply with `combine`, or with the first
    /// error in actor order.
    fn put(this: &Mutex<Self>, i: usize, r: Result<R>) {
        let done = {
            let mut g = lock(this);
            g.results[i] = Some(r);
            g.left -= 1;
            if g.left > 0 {
                return;
            }
            let (reply, combine) = g.finish.take().expect("completed once");
            (std::mem::take(&mut g.results), reply, combine)
        };
        let (results, reply, combine) = done;
        let mut oks = Vec::with_capacity(results.len());
        for r in results {
            match r.expect("every slot is filled") {
                Ok(x) => oks.push(x),
                Err(e) => return reply.send(Err(e)),
            }
        }
        reply.send(combine(oks));
    }
}

/// Runs `f(i, state)` on every actor (each behind the jobs already queued there) and completes
/// the handle with `combine(results in actor order)`, or with the first error in actor order.
/// The caller keeps the order of fan-outs identical on every actor (see `WorkerGroup`).
pub fn fan_out<'a, S: ActorState, R: Send + 'static, T: Send + 'static>(
    actors: impl IntoIterator<Item = &'a Actor<S>>,
    f: impl Fn(usize, &mut S) -> Result<R> + Send + Sync + 'static,
    combine: impl FnOnce(Vec<R>) -> Result<T> + Send + 'static,
) -> Handle<T> {
    let actors: Vec<&Actor<S>> = actors.into_iter().collect();
    if actors.is_empty() {
        return Handle::ready(combine(vec![]));
    }
    let (reply, handle) = handle::channel();
    let gather = Arc::new(Mutex::new(Gather {
        results: (0..actors.len()).map(|_| None).collect(),
        left: actors.len(),
        finish: Some((reply, Box::new(combine) as Combine<R, T>)),
    }));
    let f = Arc::new(f);
    for (i, actor) in actors.into_iter().enumerate() {
        let (g, f) = (gather.clone(), f.clone());
        if let Err(e) = actor.post(move |s| Gather::put(&g, i, f(i, s))) {
            Gather::put(&gather, i, Err(e));
        }
    }
    handle
}
