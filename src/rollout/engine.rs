//! An [`EngineCore`] on its own thread, driven through channels.
//!
//! The thread alternates: take the commands that have arrived (blocking when there is nothing
//! to decode, so an idle or paused engine costs nothing), then one `step`. Each request carries
//! its own reply channel, answered when it completes. Pause, resume and weight updates are
//! acknowledged once applied, so `pause(Keep); update_weights(..); resume()` from one caller
//! happens between two decode steps. A failed step fails the requests in flight (with the
//! reason) and the engine carries on; if the thread dies, every call returns an error instead
//! of hanging (the channels close).

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;

use super::engine_core::{EngineConfig, EngineCore, EngineStats, PauseMode, RequestId};
use super::request::{Request, RequestOutput};
use super::weights::WeightUpdate;
use crate::model::Transformer;
use crate::{Error, Result};

type Reply = Sender<Result<RequestOutput>>;

enum Command {
    Add(Request, Reply),
    Pause(PauseMode, Sender<()>),
    Resume(Sender<()>),
    Update(Box<WeightUpdate>, u64, Sender<Result<()>>),
    Health(Sender<EngineHealth>),
    Shutdown,
}

/// What an engine reports about itself.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineHealth {
    /// False when the engine thread is gone; the other fields are then empty.
    pub alive: bool,
    pub stats: Option<EngineStats>,
    pub completed_requests: u64,
    pub failed_steps: u64,
    pub last_error: Option<String>,
}

pub struct Engine {
    tx: Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

fn gone() -> Error {
    Error::Other("the engine thread has stopped".into())
}

impl Engine {
    /// Starts an engine thread owning `model`.
    pub fn start(model: Transformer, config: EngineConfig) -> Result<Engine> {
        let core = EngineCore::new(model, config)?;
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("oxrl-engine".into())
            .spawn(move || run(core, rx))
            .map_err(|e| Error::Other(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine { tx, thread: Some(thread) })
    }

    /// Queues a request; the receiver yields its output (or why it failed).
    pub fn submit(&self, req: Request) -> Result<Receiver<Result<RequestOutput>>> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Command::Add(req, tx)).map_err(|_| gone())?;
        Ok(rx)
    }

    /// Submits and waits. A request aborted by a pause returns with stop reason `abort`; see
    /// [`super::client::EngineClient::generate`] for the retry.
    pub fn generate(&self, req: Request) -> Result<RequestOutput> {
        self.submit(req)?.recv().map_err(|_| gone())?
    }

    /// Returns once the engine is paused (with `Abort`, once the aborted requests are answered).
    pub fn pause(&self, mode: PauseMode) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Command::Pause(mode, tx)).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())
    }

    pub fn resume(&self) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Command::Resume(tx)).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())
    }

    /// Returns once the new weights are in place (or why they were refused).
    pub fn update_weights(&self, update: WeightUpdate, version: u64) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Command::Update(Box::new(update), version, tx)).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())?
    }

    pub fn health(&self) -> EngineHealth {
        let dead = EngineHealth { alive: false, stats: None, completed_requests: 0, failed_steps: 0, last_error: None };
        let (tx, rx) = mpsc::channel();
        if self.tx.send(Command::Health(tx)).is_err() {
            return dead;
        }
        rx.recv().unwrap_or(dead)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut core: EngineCore, rx: Receiver<Command>) {
    let mut replies: HashMap<RequestId, Reply> = HashMap::new();
    let (mut completed, mut failed_steps, mut last_error) = (0u64, 0u64, None::<String>);
    let deliver =
        |outs: Vec<(RequestId, RequestOutput)>, replies: &mut HashMap<RequestId, Reply>, completed: &mut u64| {
            for (id, out) in outs {
                *completed += 1;
                if let Some(r) = replies.remove(&id) {
                    let _ = r.send(Ok(out));
                }
            }
        };
    loop {
        loop {
            let cmd = if core.has_work() {
                match rx.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            } else {
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => return,
                }
            };
            match cmd {
                Command::Add(req, reply) => match core.add_request(req) {
                    Ok(id) => {
                        replies.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                Command::Pause(mode, ack) => {
                    deliver(core.pause(mode), &mut replies, &mut completed);
                    let _ = ack.send(());
                }
                Command::Resume(ack) => {
                    core.resume();
                    let _ = ack.send(());
                }
                Command::Update(update, version, ack) => {
                    let _ = ack.send(core.update_weights(&update, version));
                }
                Command::Health(reply) => {
                    let _ = reply.send(EngineHealth {
                        alive: true,
                        stats: Some(core.stats()),
                        completed_requests: completed,
                        failed_steps,
                        last_error: last_error.clone(),
                    });
                }
                Command::Shutdown => {
                    for (_, r) in replies.drain() {
                        let _ = r.send(Err(Error::Other("the engine shut down".into())));
                    }
                    return;
                }
            }
        }
        match core.step() {
            Ok(outs) => deliver(outs, &mut replies, &mut completed),
            Err(e) => {
                let msg = format!("engine step failed: {e}");
                for (_, r) in replies.drain() {
                    let _ = r.send(Err(Error::Other(msg.clone())));
                }
                core.reset();
                failed_steps += 1;
                last_error = Some(msg);
            }
        }
    }
}
