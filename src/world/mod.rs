//! The processes of a run: one (a binary started on its own) or many (started by `mpirun` or
//! Slurm's `srun`, with the cargo feature `mpi`), each holding some of the data-parallel ranks.
//!
//! ```text
//! process p of W holds global dp ranks p·L .. (p+1)·L   (L = ranks per process)
//! all_gather(bytes)   -> every process's bytes, in process order
//! all_to_all(parts)   -> part p of every process, in process order
//! ```
//! Everything that crosses processes is built on these two: the gradient sum (a reduce-scatter
//! and an all-gather that add every element in global rank order, see
//! `dispatch::sum_across`, so the result is the in-process sum bit for bit whatever
//! the MPI library's reduction order), the outputs of a forward pass, work shared out by
//! [`share`] (RL's groups: each process samples its share on its own engines), and the start-up
//! check that every process runs the same binary and config. Values other than gradients cross
//! as MessagePack ([`encode`]): exact floats, NaN and infinities included. Buffers over 1 GiB
//! go in rounds (MPI counts and displacements are 32-bit).
//! MPI is initialised once per process on first use, at `MPI_THREAD_SERIALIZED` (calls come from
//! whichever rank thread arrives last, never two at once: a mutex orders them), and finalised
//! by [`finalize`] at the end of `main`.
//!
//! A job may also hold sampling engines (`mpirun -np 2 oxrl rl … : -np 2 oxrl engine …`, each
//! engine joining with [`join_as_engine`]): the trainers' world is then theirs alone (COMM_WORLD
//! split by role), every trainer knows the engines' URLs ([`job_engines`]), and trainer process 0
//! and the engines share a [`engine_link`] (trainer 0 its rank 0, the engines 1, 2, … in launch
//! order) over which weights are broadcast.

use std::sync::OnceLock;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Error, Result};

/// The processes of a run.
pub trait World: Send + Sync {
    /// This process, from 0.
    fn rank(&self) -> usize;
    /// How many processes.
    fn size(&self) -> usize;
    /// Every process's `bytes` (any lengths), in process order. Every process must call it.
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Sends `parts[q]` to process `q` (one part per process, any lengths) and returns what
    /// every process sent to this one, in process order. Every process must call it.
    fn all_to_all(&self, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>>;
    /// Process `root`'s `bytes` on every process (the others' are replaced). Every process must
    /// call it. Over MPI a process waiting here for the bytes to start polls and sleeps rather
    /// than spinning: it may wait long (for a step's groups, for the next weights) beside an
    /// engine that needs the core.
    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        let all = self.all_gather(if self.rank() == root { bytes } else { &[] })?;
        *bytes =
            all.into_iter().nth(root).ok_or_else(|| Error::Other(format!("broadcast from {root}: no such process")))?;
        Ok(())
    }
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

    fn all_to_all(&self, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        Ok(parts)
    }

    fn abort(&self, _code: i32) {}
}

static WORLD: OnceLock<Box<dyn World>> = OnceLock::new();

/// What a process of an MPI job does.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Role {
    /// `oxrl rl`, `oxrl sft`, …: holds data-parallel ranks.
    Trainer,
    /// `oxrl engine`, serving at this URL.
    Engine(String),
}

/// The engines of the job, as its trainers and engines see them.
#[derive(Default)]
struct Job {
    engines: Vec<String>,
    link: Option<Box<dyn World>>,
}

static JOB: OnceLock<Job> = OnceLock::new();

/// Whether an MPI launcher started this process (OpenMPI, MPICH / Hydra, Slurm's PMI).
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"].iter().any(|v| std::env::var_os(v).is_some())
}

/// The process's world: MPI's when a launcher started it (an error if this build has no MPI),
/// else a world of one. Initialised on first call.
pub fn world() -> Result<&'static dyn World> {
    join(Role::Trainer)
}

/// The world of this process's role, initialised (with the job's engines and link) on first call.
fn join(role: Role) -> Result<&'static dyn World> {
    if let Some(w) = WORLD.get() {
        return Ok(w.as_ref());
    }
    let (w, job): (Box<dyn World>, Job) =
        if launched_by_mpi() { mpi_world(&role)? } else { (Box::new(Single), Job::default()) };
    let _ = JOB.set(job);
    Ok(WORLD.get_or_init(|| w).as_ref())
}

/// Joins the MPI job as a sampling engine serving at `url` (`oxrl engine` started by the
/// launcher beside trainers; before any other MPI call) and returns its link to trainer
/// process 0 (see [`engine_link`]).
pub fn join_as_engine(url: &str) -> Result<&'static dyn World> {
    join(Role::Engine(url.to_string()))?;
    engine_link().ok_or_else(|| {
        Error::input("oxrl engine under mpirun: the job has no trainer (start `oxrl rl` beside it: mpirun … : …)")
    })
}

/// The world this process has joined, if any.
pub fn joined() -> Option<&'static dyn World> {
    WORLD.get().map(|w| w.as_ref())
}

/// The URLs of the job's engine processes, in launch order (empty in a job of trainers only).
pub fn job_engines() -> &'static [String] {
    JOB.get().map_or(&[], |j| &j.engines)
}

/// Trainer process 0 (rank 0) and the job's engines (1, 2, …): what rank 0 broadcasts, every
/// engine receives. `None` on other trainers and in a job without engines.
pub fn engine_link() -> Option<&'static dyn World> {
    JOB.get()?.link.as_deref()
}

/// Whether this process writes the run directory (process 0).
pub fn is_writer() -> bool {
    WORLD.get().is_none_or(|w| w.rank() == 0)
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(_role: &Role) -> Result<(Box<dyn World>, Job)> {
    Err(Error::Other(
        "started by an MPI launcher, but this oxrl was built without MPI: rebuild with `--features mpi`".into(),
    ))
}

#[cfg(feature = "mpi")]
fn mpi_world(role: &Role) -> Result<(Box<dyn World>, Job)> {
    let (world, engines, link) = mpi::init(role)?;
    Ok((Box::new(world), Job { engines, link: link.map(|l| Box::new(l) as Box<dyn World>) }))
}

/// Ends MPI (a no-op in a world of one). Call once, at the end of `main`.
pub fn finalize() {
    #[cfg(feature = "mpi")]
    mpi::finalize();
}

/// Items `0..n` computed across the world's processes: process `p` of `W` computes the items
/// `i` with `i mod W = p` (`f` gets their indices in order and returns one value each), and
/// every process gets all `n`, in order. An error in `f` returns before the gather: the caller
/// ends the run (see [`World::abort`]), as the other processes would wait for this one.
pub fn share<T: Serialize + DeserializeOwned>(
    world: &dyn World,
    n: usize,
    f: impl FnOnce(&[usize]) -> Result<Vec<T>>,
) -> Result<Vec<T>> {
    let (rank, size) = (world.rank(), world.size());
    let mine: Vec<usize> = (rank..n).step_by(size).collect();
    let values = f(&mine)?;
    if values.len() != mine.len() {
        return Err(Error::Other(format!("{} values for {} items", values.len(), mine.len())));
    }
    if size == 1 {
        return Ok(values);
    }
    let all = world.all_gather(&encode(&values)?)?;
    let mut parts = Vec::with_capacity(size);
    for (p, bytes) in all.iter().enumerate() {
        let part: Vec<T> = decode(bytes).map_err(|e| Error::Other(format!("the share of process {p}: {e}")))?;
        if part.len() != (p..n).step_by(size).count() {
            return Err(Error::Other(format!("process {p} computed {} of its items", part.len())));
        }
        parts.push(part.into_iter());
    }
    Ok((0..n).map(|i| parts[i % size].next().expect("counted above")).collect())
}

/// `value` as MessagePack (struct fields by name, so skipped fields stay optional).
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    rmp_serde::to_vec_named(value).map_err(|e| Error::Other(format!("cannot encode for another process: {e}")))
}

/// The value [`encode`] wrote.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::Other(format!("cannot decode from another process: {e}")))
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
mod mpi;

/// What the processes of a [`ThreadWorld`] share: each one's deposit for the exchange under way
/// (one message for all_gather, one per process for all_to_all), the last complete exchange, and
/// whether a process has panicked (the others then panic too instead of waiting forever).
#[cfg(test)]
#[derive(Default)]
struct Rendezvous {
    deposits: Vec<Option<Vec<Vec<u8>>>>,
    done: Vec<Vec<Vec<u8>>>,
    exchanges: u64,
    panicked: bool,
}

#[cfg(test)]
type Slots = std::sync::Arc<(std::sync::Mutex<Rendezvous>, std::sync::Condvar)>;

/// Processes played by threads, for tests: `all_gather` through a shared rendezvous.
#[cfg(test)]
pub(crate) struct ThreadWorld {
    pub rank: usize,
    slots: Slots,
}

#[cfg(test)]
impl ThreadWorld {
    /// Every process's deposit, once all have deposited. Panics if another process panicked.
    fn exchange(&self, mine: Vec<Vec<u8>>) -> Vec<Vec<Vec<u8>>> {
        let (lock, cv) = &*self.slots;
        let gone = "another process of this test world panicked";
        let mut r = lock.lock().unwrap_or_else(|e| e.into_inner());
        assert!(!r.panicked, "{gone}");
        let exchange = r.exchanges;
        r.deposits[self.rank] = Some(mine);
        if r.deposits.iter().all(Option::is_some) {
            r.done = r.deposits.iter_mut().map(|d| d.take().expect("every process deposited")).collect();
            r.exchanges += 1;
            cv.notify_all();
        }
        while r.exchanges == exchange {
            assert!(!r.panicked, "{gone}");
            r = cv.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        // The next exchange cannot complete before this process deposits for it.
        r.done.clone()
    }

    /// The `size` processes of one world.
    pub fn world(size: usize) -> Vec<ThreadWorld> {
        let shared = Rendezvous { deposits: vec![None; size], ..Default::default() };
        let slots = std::sync::Arc::new((std::sync::Mutex::new(shared), std::sync::Condvar::new()));
        (0..size).map(|rank| ThreadWorld { rank, slots: slots.clone() }).collect()
    }
}

/// A process that panics wakes the others, which would otherwise wait for it forever.
#[cfg(test)]
impl Drop for ThreadWorld {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let (lock, cv) = &*self.slots;
            lock.lock().unwrap_or_else(|e| e.into_inner()).panicked = true;
            cv.notify_all();
        }
    }
}

#[cfg(test)]
impl World for ThreadWorld {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.slots.0.lock().unwrap_or_else(|e| e.into_inner()).deposits.len()
    }
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let all = self.exchange(vec![bytes.to_vec()]);
        Ok(all.into_iter().map(|mut d| d.remove(0)).collect())
    }
    fn all_to_all(&self, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let all = self.exchange(parts);
        Ok(all.into_iter().map(|mut d| d.swap_remove(self.rank)).collect())
    }
    fn abort(&self, _code: i32) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 3 processes share 8 items: each computes only its own (`i mod 3`), every one gets all 8
    /// in order, and floats cross with their bits (NaN, infinities, -0.0).
    #[test]
    fn shared_items_come_back_whole_and_in_order() {
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 1e-45, f32::MAX, 0.1, -7.5];
        let value = |i: usize| (i, vec![specials[i]; i % 3]);
        let worlds = ThreadWorld::world(3);
        type Item = (usize, Vec<f32>);
        let got: Vec<(Vec<usize>, Vec<Item>)> = std::thread::scope(|s| {
            let hs: Vec<_> = (worlds.iter())
                .map(|w| {
                    s.spawn(move || {
                        let mut asked = vec![];
                        let all = share(w, 8, |mine| {
                            asked = mine.to_vec();
                            Ok(mine.iter().map(|&i| value(i)).collect())
                        })
                        .unwrap();
                        (asked, all)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let bits = |v: &[Item]| -> Vec<(usize, Vec<u32>)> {
            v.iter().map(|(i, x)| (*i, x.iter().map(|f| f.to_bits()).collect())).collect()
        };
        let expected: Vec<Item> = (0..8).map(value).collect();
        for (p, (asked, all)) in got.iter().enumerate() {
            assert_eq!(*asked, (p..8).step_by(3).collect::<Vec<_>>(), "process {p} computed others' items");
            assert_eq!(bits(all), bits(&expected), "process {p}");
        }
    }

    /// A process that panics before an exchange makes the others panic in it, not wait forever.
    #[test]
    fn a_panicking_process_wakes_the_others() {
        let outcomes: Vec<bool> = std::thread::scope(|s| {
            let hs: Vec<_> = ThreadWorld::world(3)
                .into_iter()
                .map(|w| {
                    s.spawn(move || {
                        assert_eq!(w.all_gather(&[w.rank as u8]).unwrap().len(), 3);
                        assert!(w.rank != 2, "process 2 fails after one exchange");
                        w.all_gather(b"second").unwrap();
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().is_ok()).collect()
        });
        assert_eq!(outcomes, vec![false, false, false]);
    }

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
