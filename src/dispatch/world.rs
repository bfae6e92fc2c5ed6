//! The processes of a run: one (a binary started on its own) or many (started by `mpirun` or
//! Slurm's `srun`, with the cargo feature `mpi`), each holding some of the data-parallel ranks.
//!
//! ```text
//! process p of W holds global dp ranks p·L .. (p+1)·L   (L = ranks per process)
//! all_gather(bytes)  -> every process's bytes, in process order   (the only cross-process op)
//! ```
//! Everything that crosses processes is built on [`World::all_gather`]: the gradient sum (each
//! process gathers every rank's gradients and sums them in global rank order, so the result is
//! the in-process sum bit for bit, whatever the MPI library's reduction order), the outputs of a
//! forward pass, and the start-up check that every process runs the same binary and config.
//! MPI is initialised once per process on first use, at `MPI_THREAD_SERIALIZED` (calls come from
//! whichever rank thread arrives last, never two at once: a mutex orders them), and finalised
//! by [`finalize`] at the end of `main`.

use std::sync::OnceLock;

use crate::{Error, Result};

/// The processes of a run.
pub trait World: Send + Sync {
    /// This process, from 0.
    fn rank(&self) -> usize;
    /// How many processes.
    fn size(&self) -> usize;
    /// Every process's `bytes` (any lengths), in process order. Every process must call it.
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Ends every process of the run with `code` (after an error here: the others would wait
    /// for this one forever). Does not return in a world of many.
    fn abort(&self, code: i32);
}

/// A world of one process (no launcher).
pub struct Single;

impl World for Single {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![bytes.to_vec()])
    }

    fn abort(&self, _code: i32) {}
}

static WORLD: OnceLock<Box<dyn World>> = OnceLock::new();

/// Whether an MPI launcher started this process (OpenMPI, MPICH / Hydra, Slurm's PMI).
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"].iter().any(|v| std::env::var_os(v).is_some())
}

/// The process's world: MPI's when a launcher started it (an error if this build has no MPI),
/// else a world of one. Initialised on first call.
pub fn world() -> Result<&'static dyn World> {
    if let Some(w) = WORLD.get() {
        return Ok(w.as_ref());
    }
    let w: Box<dyn World> = if launched_by_mpi() { mpi_world()? } else { Box::new(Single) };
    Ok(WORLD.get_or_init(|| w).as_ref())
}

/// Whether this process writes the run directory (process 0).
pub fn is_writer() -> bool {
    WORLD.get().is_none_or(|w| w.rank() == 0)
}

#[cfg(not(feature = "mpi"))]
fn mpi_world() -> Result<Box<dyn World>> {
    Err(Error::Other(
        "started by an MPI launcher, but this oxrl was built without MPI: rebuild with `--features mpi`".into(),
    ))
}

#[cfg(feature = "mpi")]
fn mpi_world() -> Result<Box<dyn World>> {
    Ok(Box::new(mpi_impl::MpiWorld::init()?))
}

/// Ends MPI (a no-op in a world of one). Call once, at the end of `main`.
pub fn finalize() {
    #[cfg(feature = "mpi")]
    mpi_impl::finalize();
}

/// Checks that every process runs the same binary on the same resolved config: gathers a hash
/// of both and names the processes that differ from process 0.
pub fn check_same_run(config_text: &str) -> Result<()> {
    let w = world()?;
    if w.size() == 1 {
        return Ok(());
    }
    let mine = format!("{} {:016x}", env!("CARGO_PKG_VERSION"), fnv1a(config_text.as_bytes()));
    let all = w.all_gather(mine.as_bytes())?;
    let differ: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, h)| *h != &all[0])
        .map(|(p, h)| format!("process {p} ({})", String::from_utf8_lossy(h)))
        .collect();
    if differ.is_empty() {
        Ok(())
    } else {
        Err(Error::input(format!(
            "the processes of this run differ from process 0 ({}) in binary version or resolved config: {}",
            String::from_utf8_lossy(&all[0]),
            differ.join(", ")
        )))
    }
}

/// FNV-1a, 64 bits: a stable hash (std's is seeded per process).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

#[cfg(feature = "mpi")]
mod mpi_impl {
    use std::sync::Mutex;

    use mpi::datatype::PartitionMut;
    use mpi::traits::*;
    use mpi::{Count, Threading};

    use super::World;
    use crate::{Error, Result};

    /// MPI counts are 32-bit: larger buffers go in rounds of at most this many bytes each.
    const BUCKET: usize = 1 << 30;

    static UNIVERSE: Mutex<Option<mpi::environment::Universe>> = Mutex::new(None);

    pub struct MpiWorld {
        rank: usize,
        size: usize,
        /// Serialises MPI calls (`MPI_THREAD_SERIALIZED`).
        calls: Mutex<()>,
    }

    impl MpiWorld {
        pub fn init() -> Result<MpiWorld> {
            let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
                .ok_or_else(|| Error::Other("MPI was initialised already".into()))?;
            if provided < Threading::Serialized {
                return Err(Error::Other(format!(
                    "the MPI library provides thread level {provided:?}; oxrl needs Serialized"
                )));
            }
            let world = universe.world();
            let (rank, size) = (world.rank() as usize, world.size() as usize);
            *UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()) = Some(universe);
            Ok(MpiWorld { rank, size, calls: Mutex::new(()) })
        }
    }

    pub fn finalize() {
        // Dropping the universe calls MPI_Finalize.
        drop(UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

    impl World for MpiWorld {
        fn rank(&self) -> usize {
            self.rank
        }

        fn size(&self) -> usize {
            self.size
        }

        fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
            let _serial = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            let world = mpi::topology::SimpleCommunicator::world();
            let mut lens = vec![0u64; self.size];
            world.all_gather_into(&(bytes.len() as u64), &mut lens[..]);
            let mut out: Vec<Vec<u8>> = lens.iter().map(|&n| Vec::with_capacity(n as usize)).collect();
            let rounds = lens.iter().map(|&n| (n as usize).div_ceil(BUCKET)).max().unwrap_or(0);
            for r in 0..rounds {
                let piece = |n: usize| n.saturating_sub(r * BUCKET).min(BUCKET);
                let counts: Vec<Count> = lens.iter().map(|&n| piece(n as usize) as Count).collect();
                let displs: Vec<Count> = counts
                    .iter()
                    .scan(0 as Count, |at, &c| {
                        let d = *at;
                        *at += c;
                        Some(d)
                    })
                    .collect();
                let total: usize = counts.iter().map(|&c| c as usize).sum();
                let mut recv = vec![0u8; total];
                let mine = &bytes[(r * BUCKET).min(bytes.len())..][..piece(bytes.len())];
                {
                    let mut partition = PartitionMut::new(&mut recv[..], &counts[..], &displs[..]);
                    world.all_gather_varcount_into(mine, &mut partition);
                }
                for (p, o) in out.iter_mut().enumerate() {
                    let (d, c) = (displs[p] as usize, counts[p] as usize);
                    o.extend_from_slice(&recv[d..d + c]);
                }
            }
            Ok(out)
        }

        fn abort(&self, code: i32) {
            mpi::topology::SimpleCommunicator::world().abort(code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_of_one_gathers_its_own_bytes() {
        assert_eq!(Single.all_gather(b"abc").unwrap(), vec![b"abc".to_vec()]);
        assert_eq!((Single.rank(), Single.size()), (0, 1));
    }

    #[test]
    fn the_run_hash_is_stable() {
        // FNV-1a's published test vectors.
        assert_eq!(fnv1a(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x85944171f73967e8);
    }
}
