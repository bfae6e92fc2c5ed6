//! Dispatch building blocks: mesh registration, split/merge, the in-process all-reduce, and the
//! residency state machine of colocated models.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use oxrl::dispatch::collective::{Collective, InProcess};
use oxrl::dispatch::mesh::{MeshCoord, MeshRegistry, MeshShape};
use oxrl::dispatch::residency::{Move, Parts, Residency};
use oxrl::dispatch::split::{lcm, merge_outputs, pad_and_split};

#[test]
fn mesh_collection_ranks_and_registration() {
    let shape = MeshShape { dp: 2, tp: 2, sp: 1, pp: 1 };
    let coords = shape.coords();
    assert_eq!(coords.len(), 4);
    let collect: Vec<bool> = coords.iter().map(|c| shape.is_collection(c)).collect();
    assert_eq!(collect, vec![true, false, true, false]);
    assert_eq!(coords.iter().map(|c| c.dp).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
    let pp = MeshShape { dp: 1, tp: 1, sp: 1, pp: 3 };
    assert_eq!(pp.coords().iter().map(|c| pp.is_collection(c)).collect::<Vec<_>>(), vec![false, false, true]);

    let mut reg = MeshRegistry::default();
    let info = reg.register("policy", &shape, coords[3]).unwrap();
    assert_eq!((info.dp_rank, info.dp_size, info.collect), (1, 2, false));
    let err = reg.register("policy", &shape, coords[2]).unwrap_err().to_string();
    assert!(err.contains("policy") && err.contains("already registered"), "{err}");
    // Another worker instance has its own registry.
    let mut other = MeshRegistry::default();
    assert!(other.register("policy", &shape, coords[0]).unwrap().collect);
    assert!(reg.get("ref").unwrap_err().to_string().contains("ref"));
    assert!(reg.register("x", &shape, MeshCoord { dp: 2, tp: 0, sp: 0, pp: 0 }).is_err());
    assert!(MeshShape::dp(0).validate().is_err());
}

#[test]
fn pad_split_and_merge_round_trip() {
    let batch: Vec<i32> = (1..=5).collect();
    for dp in 1..=4 {
        let s = pad_and_split(&batch, dp, |x| -x).unwrap();
        assert_eq!(s.chunks.len(), dp);
        let per = s.chunks[0].len();
        assert!(s.chunks.iter().all(|c| c.len() == per), "equal chunks");
        assert_eq!(per * dp, 5usize.div_ceil(dp) * dp);
        // Padding copies the first datum (marked here by negation) and sits at the end.
        let flat: Vec<i32> = s.chunks.concat();
        assert_eq!(&flat[..5], &batch[..]);
        assert!(flat[5..].iter().all(|&x| x == -1));
        let merged = merge_outputs(s.chunks.clone(), s.real);
        assert_eq!(merged, batch);
    }
    assert!(pad_and_split::<i32>(&[], 2, |x| *x).unwrap_err().to_string().contains("empty batch"));
    assert_eq!(lcm(&[2, 3, 4]), 12);
    assert_eq!(lcm(&[1]), 1);
}

#[test]
fn in_process_all_reduce_sums_in_rank_order_across_threads() {
    for n in [1usize, 2, 3, 4] {
        let c = Arc::new(InProcess::new(n));
        // Three successive collectives on the same object.
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let c = c.clone();
                std::thread::spawn(move || {
                    let mut outs = vec![];
                    for round in 0..3 {
                        let t = Tensor::new(&[rank as f32 + 1.0, (round * 10) as f32], &Device::Cpu).unwrap();
                        let r = c.all_reduce_sum(rank, vec![t]).unwrap();
                        outs.push(r[0].to_vec1::<f32>().unwrap());
                    }
                    outs
                })
            })
            .collect();
        let total: f32 = (1..=n).map(|x| x as f32).sum();
        for h in handles {
            let outs = h.join().unwrap();
            for (round, o) in outs.iter().enumerate() {
                assert_eq!(o, &vec![total, (round * 10 * n) as f32]);
            }
        }
    }
}

#[test]
fn aborted_all_reduce_wakes_waiting_ranks_with_an_error() {
    let c = Arc::new(InProcess::new(2));
    let c2 = c.clone();
    let waiter = std::thread::spawn(move || c2.all_reduce_sum(0, vec![Tensor::new(&[1f32], &Device::Cpu).unwrap()]));
    std::thread::sleep(std::time::Duration::from_millis(50));
    c.abort("rank 1 failed: bad datum");
    let err = waiter.join().unwrap().unwrap_err().to_string();
    assert!(err.contains("rank 1 failed"), "{err}");
}

#[test]
fn residency_follows_the_colocation_rules() {
    let mut r = Residency::default();
    let off = |id: &str, p| Move::Offload(id.to_string(), p);
    let back = |id: &str, p| Move::Backload(id.to_string(), p);
    assert_eq!(r.init_model("policy"), vec![]);
    assert_eq!(r.resident("policy"), Parts::ALL);
    // A new model: the policy goes to the host entirely.
    assert_eq!(r.init_model("ref"), vec![off("policy", Parts::ALL)]);
    assert_eq!(r.resident("policy"), Parts::NONE);
    assert_eq!(r.resident("ref"), Parts::ALL);
    // Forward of the policy needs only its model.
    assert_eq!(r.prepare("policy", Parts::MODEL), vec![off("ref", Parts::ALL), back("policy", Parts::MODEL)]);
    assert_eq!(r.resident("policy"), Parts::MODEL);
    // A training step then brings back only the optimizer.
    assert_eq!(r.prepare("policy", Parts::ALL), vec![back("policy", Parts { model: false, optimizer: true })]);
    // Running again with everything resident moves nothing.
    assert_eq!(r.prepare("policy", Parts::ALL), vec![]);
    assert_eq!(r.prepare("policy", Parts::MODEL), vec![]);
    // The critic: the policy leaves with both parts.
    let moves = r.prepare("critic", Parts::ALL);
    assert_eq!(moves, vec![off("policy", Parts::ALL), back("critic", Parts::ALL)]);
    // A dropped model is forgotten: nothing of it is resident and nothing moves it.
    r.forget("critic");
    assert_eq!(r.resident("critic"), Parts::NONE);
    assert_eq!(r.prepare("policy", Parts::MODEL), vec![back("policy", Parts::MODEL)]);
}
