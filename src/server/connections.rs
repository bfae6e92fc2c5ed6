//! The server's connections, bounded: at most `max_connections` open at once (a new one waits
//! in the kernel's backlog for a free slot, so the process never runs out of file descriptors),
//! and one the server is waiting to read from that sends nothing for `idle_timeout` is closed (a
//! client that opens connections and never finishes its headers holds a slot that long at
//! most). The idle timeout must exceed the long-poll time: an idle keep-alive connection is
//! closed, a long poll never is.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

pub struct BoundedListener {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    idle: Duration,
}

impl BoundedListener {
    pub fn new(listener: TcpListener, max_connections: usize, idle: Duration) -> Self {
        BoundedListener { listener, slots: Arc::new(Semaphore::new(max_connections.max(1))), idle }
    }
}

impl axum::serve::Listener for BoundedListener {
    type Io = Connection;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Connection, std::net::SocketAddr) {
        let slot = self.slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        loop {
            match self.listener.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    return (Connection { stream, _slot: slot, idle: self.idle, waiting: None }, addr);
                }
                // Out of descriptors or a connection reset before it was taken: try again soon.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }
}

/// A connection holding its slot; reads time out after `idle` without a byte.
pub struct Connection {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    idle: Duration,
    /// Armed while a read waits for bytes.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl AsyncRead for Connection {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Pending => {
                let idle = this.idle;
                let timer = this.waiting.get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "idle connection"))),
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                this.waiting = None;
                ready
            }
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
