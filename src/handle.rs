//! [`Handle`]: the result of a call that is still running, to be awaited or waited on.
//!
//! Every call on a worker group, an engine or the engine client is submitted to the thread that
//! owns the state and returns a `Handle` at once. The owner answers through the matching
//! [`Reply`] (a tokio oneshot channel), so the same handle serves both worlds:
//! - from async code (the server, the asynchronous trainer): `handle.await`;
//! - from a plain thread (the CLI, the synchronous trainer, tests): `handle.wait()`.
//!
//! A handle may carry a cancel hook ([`Handle::cancel`]): asking for cancellation never loses
//! the answer; the call still completes (for a sampling request: with what it has so far).
//! If the owner stops without answering (its thread died), the handle yields an error instead
//! of hanging.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::{Error, Result};

/// The answer to one submitted call; see the module documentation.
pub struct Handle<T> {
    rx: oneshot::Receiver<Result<T>>,
    cancel: Option<Arc<dyn Fn() + Send + Sync>>,
}

/// The sending half: whoever runs the call answers through it exactly once.
pub struct Reply<T>(oneshot::Sender<Result<T>>);

/// A new handle and the reply that completes it.
pub fn channel<T>() -> (Reply<T>, Handle<T>) {
    let (tx, rx) = oneshot::channel();
    (Reply(tx), Handle { rx, cancel: None })
}

fn dropped() -> Error {
    Error::Other("the call was dropped before it answered (its worker or engine thread stopped)".into())
}

impl<T> Reply<T> {
    /// Delivers the result; a handle that was dropped meanwhile simply never sees it.
    pub fn send(self, result: Result<T>) {
        let _ = self.0.send(result);
    }
}

impl<T> Handle<T> {
    /// A handle that is already complete (e.g. a call refused before it was submitted).
    pub fn ready(result: Result<T>) -> Self {
        let (reply, handle) = channel();
        reply.send(result);
        handle
    }

    /// Attaches a cancel hook (see [`Handle::cancel`]).
    pub fn with_cancel(mut self, cancel: impl Fn() + Send + Sync + 'static) -> Self {
        self.cancel = Some(Arc::new(cancel));
        self
    }

    /// The cancel hook, to cancel the call from elsewhere once the handle is being awaited.
    pub fn canceller(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        self.cancel.clone()
    }

    /// Asks the owner to cancel the call; the handle still completes. A no-op for calls that
    /// cannot be cancelled or have finished.
    pub fn cancel(&self) {
        if let Some(c) = &self.cancel {
            c();
        }
    }

    /// Blocks the current thread until the result arrives. Not for async code (it would block
    /// the executor; tokio panics if asked): `.await` the handle there.
    pub fn wait(self) -> Result<T> {
        self.rx.blocking_recv().unwrap_or_else(|_| Err(dropped()))
    }

    /// The result if it has arrived, without blocking.
    pub fn try_wait(&mut self) -> Option<Result<T>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(dropped())),
        }
    }
}

impl<T> Future for Handle<T> {
    type Output = Result<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        Pin::new(&mut self.rx).poll(cx).map(|r| r.unwrap_or_else(|_| Err(dropped())))
    }
}
