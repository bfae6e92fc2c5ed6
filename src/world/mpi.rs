//! The MPI implementation of [`World`](super::World) (cargo feature `mpi`).

use std::sync::Mutex;

use ::mpi::collective::SystemOperation;
use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::topology::{Color, SimpleCommunicator};
use ::mpi::traits::*;
use ::mpi::{Count, Threading};

use super::{Role, World};
use crate::locks::lock;
use crate::{Error, Result};

/// MPI counts are 32-bit: larger buffers go in rounds of at most this many bytes from each
/// process (fewer when the displacements of all processes' pieces would pass 2³¹).
const BUCKET: usize = 1 << 30;

/// Bytes `[r·bucket, (r+1)·bucket)` of a buffer of `n`: how many there are.
fn piece(n: usize, r: usize, bucket: usize) -> usize {
    n.saturating_sub(r * bucket).min(bucket)
}

/// Rounds of `bucket` bytes that carry `longest`.
fn rounds(longest: usize, bucket: usize) -> usize {
    longest.div_ceil(bucket)
}

/// Each piece's displacement: the counts before it.
fn offsets(counts: &[Count]) -> Vec<Count> {
    counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect()
}

static UNIVERSE: Mutex<Option<mpi::environment::Universe>> = Mutex::new(None);

/// Serialises this process's MPI calls, on every communicator (`MPI_THREAD_SERIALIZED`).
static CALLS: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    lock(&CALLS)
}

/// A communicator that threads may share: every call on it holds [`CALLS`].
struct Comm(SimpleCommunicator);

// SAFETY: an MPI communicator handle is a process-wide value, and at MPI_THREAD_SERIALIZED
// any thread may use it so long as no two calls run at once, which `CALLS` ensures.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

pub struct MpiWorld {
    rank: usize,
    size: usize,
    comm: Comm,
}

/// Initialises MPI and splits the job by role: this process's world (trainers or engines),
/// the engines' URLs in launch order, and (trainer 0 and engines) their link.
pub fn init(role: &Role) -> Result<(MpiWorld, Vec<String>, Option<MpiWorld>)> {
    let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
        .ok_or_else(|| Error::Other("MPI was initialised already".into()))?;
    if provided < Threading::Serialized {
        return Err(Error::Other(format!("the MPI library provides thread level {provided:?}; oxrl needs Serialized")));
    }
    *lock(&UNIVERSE) = Some(universe);
    let job = MpiWorld::over(SimpleCommunicator::world());
    let roles: Vec<Role> =
        job.all_gather(&super::encode(role)?)?.iter().map(|b| super::decode(b)).collect::<Result<_>>()?;
    let engines: Vec<String> =
        roles.iter().filter_map(|r| if let Role::Engine(url) = r { Some(url.clone()) } else { None }).collect();
    if engines.is_empty() {
        return Ok((job, engines, None));
    }
    let Some(trainer0) = roles.iter().position(|r| *r == Role::Trainer) else {
        return Ok((job, engines, None)); // engines alone: join_as_engine says why that fails
    };
    let me = job.rank;
    let world = job.comm.0.split_by_color(Color::with_value((*role != Role::Trainer) as i32));
    let in_link = me == trainer0 || *role != Role::Trainer;
    let color = if in_link { Color::with_value(0) } else { Color::undefined() };
    let link = job.comm.0.split_by_color_with_key(color, if me == trainer0 { 0 } else { 1 + me as i32 });
    let world = world.ok_or_else(|| Error::Other("MPI_Comm_split gave no communicator".into()))?;
    Ok((MpiWorld::over(world), engines, link.map(MpiWorld::over)))
}

pub fn finalize() {
    // Dropping the universe calls MPI_Finalize.
    drop(lock(&UNIVERSE).take());
}

impl MpiWorld {
    fn over(comm: SimpleCommunicator) -> MpiWorld {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        MpiWorld { rank, size, comm: Comm(comm) }
    }

    /// The bytes a process sends in one round: every displacement must fit in a `Count`.
    fn bucket(&self) -> usize {
        BUCKET.min(Count::MAX as usize / self.size)
    }

    /// Root's `buf` on every process. Every process uses the nonblocking broadcast (MPI
    /// matches a blocking collective only with blocking ones); with `poll`, one that is not
    /// the root tests for it every 200 µs, sleeping between (for a wait of unknown length),
    /// else it waits in MPI (which drives the transfer: a large body goes at full speed).
    fn broadcast_in<T: Equivalence>(&self, root: usize, buf: &mut [T], poll: bool) {
        let root = self.comm.0.process_at_rank(root as i32);
        let poll = poll && self.rank != root.rank() as usize;
        mpi::request::scope(|scope| {
            let mut request = root.immediate_broadcast_into(scope, buf);
            if !poll {
                request.wait();
                return;
            }
            loop {
                match request.test() {
                    Ok(_) => break,
                    Err(pending) => request = pending,
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        });
    }
}

impl MpiWorld {
    /// Every process's `len`, by a nonblocking all-gather polled with short sleeps after a brief
    /// spin. This is where a process that arrives first waits for the others (the data that
    /// follows moves at full speed): waiting in MPI would spin on a core, and where processes
    /// share cores (more ranks than cores, or a prefetch beside the compute) the spinning one
    /// takes the time of those still computing.
    fn all_gather_lens(&self, len: u64) -> Vec<u64> {
        let mut lens = vec![0u64; self.size];
        mpi::request::scope(|scope| {
            let mut request = self.comm.0.immediate_all_gather_into(scope, &len, &mut lens[..]);
            let start = std::time::Instant::now();
            loop {
                match request.test() {
                    Ok(_) => break,
                    Err(pending) => request = pending,
                }
                if start.elapsed() > std::time::Duration::from_micros(50) {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            }
        });
        lens
    }
}

/// `len` zero bytes in an allocated buffer, also when `len` is 0: an empty `Vec`'s dangling
/// pointer is 1, which Open MPI reads as `MPI_IN_PLACE` and refuses.
fn zeroed(len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len.max(1));
    v.resize(len, 0);
    v
}

impl World for MpiWorld {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let _serial = serial();
        let world = &self.comm.0;
        let lens = self.all_gather_lens(bytes.len() as u64);
        let lens: Vec<usize> = lens.iter().map(|&n| n as usize).collect();
        let mut out: Vec<Vec<u8>> = lens.iter().map(|&n| Vec::with_capacity(n)).collect();
        let bucket = self.bucket();
        for r in 0..rounds(lens.iter().copied().max().unwrap_or(0), bucket) {
            let counts: Vec<Count> = lens.iter().map(|&n| piece(n, r, bucket) as Count).collect();
            let displs = offsets(&counts);
            let mut recv = zeroed(counts.iter().map(|&c| c as usize).sum());
            let mut mine = zeroed(0);
            mine.extend_from_slice(&bytes[(r * bucket).min(bytes.len())..][..piece(bytes.len(), r, bucket)]);
            {
                let mut partition = PartitionMut::new(&mut recv[..], &counts[..], &displs[..]);
                world.all_gather_varcount_into(&mine[..], &mut partition);
            }
            for (p, o) in out.iter_mut().enumerate() {
                o.extend_from_slice(&recv[displs[p] as usize..][..counts[p] as usize]);
            }
        }
        Ok(out)
    }

    fn all_to_all(&self, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        if parts.len() != self.size {
            return Err(Error::Other(format!("all_to_all: {} parts for {} processes", parts.len(), self.size)));
        }
        let _serial = serial();
        let world = &self.comm.0;
        let send_lens: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
        let mut recv_lens = vec![0u64; self.size];
        world.all_to_all_into(&send_lens[..], &mut recv_lens[..]);
        let (send_lens, recv_lens): (Vec<usize>, Vec<usize>) =
            (send_lens.iter().map(|&n| n as usize).collect(), recv_lens.iter().map(|&n| n as usize).collect());
        // Every process must run the same rounds: the longest part anywhere decides.
        let longest = send_lens.iter().copied().max().unwrap_or(0) as u64;
        let mut longest_anywhere = 0u64;
        world.all_reduce_into(&longest, &mut longest_anywhere, SystemOperation::max());
        let mut out: Vec<Vec<u8>> = recv_lens.iter().map(|&n| Vec::with_capacity(n)).collect();
        let bucket = self.bucket();
        for r in 0..rounds(longest_anywhere as usize, bucket) {
            let send_counts: Vec<Count> = send_lens.iter().map(|&n| piece(n, r, bucket) as Count).collect();
            let recv_counts: Vec<Count> = recv_lens.iter().map(|&n| piece(n, r, bucket) as Count).collect();
            let (send_displs, recv_displs) = (offsets(&send_counts), offsets(&recv_counts));
            let mut send = zeroed(0);
            for (p, part) in parts.iter().enumerate() {
                send.extend_from_slice(&part[(r * bucket).min(part.len())..][..send_counts[p] as usize]);
            }
            let mut recv = zeroed(recv_counts.iter().map(|&c| c as usize).sum());
            {
                let send = Partition::new(&send[..], &send_counts[..], &send_displs[..]);
                let mut recv = PartitionMut::new(&mut recv[..], &recv_counts[..], &recv_displs[..]);
                world.all_to_all_varcount_into(&send, &mut recv);
            }
            for (p, o) in out.iter_mut().enumerate() {
                o.extend_from_slice(&recv[recv_displs[p] as usize..][..recv_counts[p] as usize]);
            }
        }
        Ok(out)
    }

    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        let _serial = serial();
        // The length may be long in coming (the next step's groups, the next weights): polled.
        let mut len = [bytes.len() as u64];
        self.broadcast_in(root, &mut len, true);
        if self.rank != root {
            bytes.clear();
            bytes.resize(len[0] as usize, 0);
        }
        for piece in bytes.chunks_mut(BUCKET) {
            self.broadcast_in(root, piece, false);
        }
        Ok(())
    }

    fn abort(&self, code: i32) {
        // The whole job: its other processes would wait for this one.
        SimpleCommunicator::world().abort(code)
    }
}
