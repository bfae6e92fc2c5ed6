//! Weights from trainer process 0 to the sampling engines of its MPI job, broadcast over the
//! job's engine link ([`engine_link`]: trainer 0 is its
//! rank 0, the engines 1, 2, …) instead of one HTTP push per engine.
//!
//! ```text
//! trainer 0                                      each engine (a thread of `oxrl engine`)
//! broadcast Header::Weights { bytes, version }   receive the header
//! broadcast the body, in pieces of 64 MiB        receive them; apply the whole (atomically)
//! gather                                         send Ok, or why the weights were refused
//! … next push …
//! broadcast Header::End                          stop serving, leave the job
//! ```
//! The body is the HTTP push's (safetensors, [`SamplerWeights::to_safetensors`]) and an engine
//! applies it with the same code, so both ways give the same engine state. A refused push leaves
//! that engine on its old weights and names it in the trainer's error. An engine process that dies
//! ends the MPI job (MPI's rule), so unlike engines reached over HTTP there is no routing around it.

use serde::{Deserialize, Serialize};

use crate::model::SamplerWeights;
use crate::world::{decode, encode, engine_link, World};
use crate::{Error, Result};

/// What one broadcast piece holds at most: large models go in several, so MPI can pipeline them.
pub const PIECE: usize = 64 << 20;

#[derive(Debug, Serialize, Deserialize)]
enum Header {
    Weights { bytes: u64, version: u64 },
    End,
}

/// Trainer 0: sends `weights` to every engine of `link` and returns once each has applied them;
/// engines that refused them are named (`urls[i]` is engine `i + 1` of the link).
pub fn send_weights(link: &dyn World, urls: &[String], weights: &SamplerWeights) -> Result<()> {
    send(link, urls, &weights.to_safetensors()?, weights.version(), PIECE)
}

fn send(link: &dyn World, urls: &[String], body: &[u8], version: u64, piece: usize) -> Result<()> {
    let mut header = encode(&Header::Weights { bytes: body.len() as u64, version })?;
    link.broadcast(0, &mut header)?;
    for chunk in body.chunks(piece) {
        link.broadcast(0, &mut chunk.to_vec())?;
    }
    let verdicts = link.all_gather(&[])?;
    let refused: Vec<String> = (verdicts.iter().enumerate().skip(1))
        .filter_map(|(i, v)| {
            let why: Option<String> = decode(v).ok()?;
            why.map(|why| format!("{}: {why}", urls.get(i - 1).map_or("an engine of the job", String::as_str)))
        })
        .collect();
    if refused.is_empty() {
        Ok(())
    } else {
        Err(Error::Other(format!("weights version {version} refused by {}", refused.join("; "))))
    }
}

/// Trainer 0: tells the engines of the job that it is over (each stops serving and leaves).
pub fn send_end(link: &dyn World) -> Result<()> {
    link.broadcast(0, &mut encode(&Header::End)?)
}

/// At the end of a trainer's `main`: releases the job's engines (trainer 0; a no-op elsewhere).
pub fn release_engines() -> Result<()> {
    match engine_link() {
        Some(link) if link.rank() == 0 => send_end(link),
        _ => Ok(()),
    }
}

/// An engine: receives every push of trainer 0 and `apply`s it (the safetensors body; `Err`
/// with why it was refused), until the end of the job.
pub fn serve_weights(link: &dyn World, mut apply: impl FnMut(&[u8]) -> std::result::Result<(), String>) -> Result<()> {
    loop {
        let mut header = vec![];
        link.broadcast(0, &mut header)?;
        let (bytes, version) = match decode(&header)? {
            Header::End => return Ok(()),
            Header::Weights { bytes, version } => (bytes as usize, version),
        };
        let mut body = Vec::with_capacity(bytes);
        while body.len() < bytes {
            let mut chunk = vec![];
            link.broadcast(0, &mut chunk)?;
            if chunk.is_empty() {
                return Err(Error::Other(format!("weights version {version}: the broadcast ended early")));
            }
            body.extend_from_slice(&chunk);
        }
        let verdict = apply(&body).err();
        link.all_gather(&encode(&verdict)?)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::ThreadWorld;

    /// Trainer 0 and two engines as threads: bodies of every size around the piece (empty,
    /// one byte, a piece, a piece and one) reach both engines whole and in order; a refusal
    /// names its engine; the end stops both.
    #[test]
    fn pushes_arrive_whole_and_refusals_are_named() {
        let bodies: Vec<Vec<u8>> =
            [0usize, 1, 7, 8, 9, 23].iter().map(|&n| (0..n).map(|i| (i * 37 + n) as u8).collect()).collect();
        let urls = vec!["http://e1".to_string(), "http://e2".to_string()];
        let link = ThreadWorld::world(3);
        let got = std::thread::scope(|s| {
            let engines: Vec<_> = (link[1..].iter())
                .map(|l| {
                    s.spawn(move || {
                        let mut seen = vec![];
                        serve_weights(l, |body| {
                            seen.push(body.to_vec());
                            if l.rank() == 2 && body.len() == 9 {
                                Err("no room".into())
                            } else {
                                Ok(())
                            }
                        })
                        .unwrap();
                        seen
                    })
                })
                .collect();
            let results: Vec<Result<()>> = bodies.iter().map(|b| send(&link[0], &urls, b, 5, 8)).collect();
            send_end(&link[0]).unwrap();
            (results, engines.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>())
        });
        let (results, seen) = got;
        for (b, r) in bodies.iter().zip(&results) {
            match b.len() {
                9 => assert_eq!(r.as_ref().unwrap_err().to_string(), "weights version 5 refused by http://e2: no room"),
                _ => assert!(r.is_ok(), "{r:?}"),
            }
        }
        assert_eq!(seen, vec![bodies.clone(), bodies]);
    }
}
