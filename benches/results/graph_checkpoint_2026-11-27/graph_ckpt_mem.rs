// Peak RSS of one training forward + backward through candle's graph (the path off the CPU tape),
// whole or checkpointed (model/graph_checkpoint.rs), on the CPU. Not built by default: copy it to
// examples/ and run
//   cargo build --release --features mpi --example graph_ckpt_mem
//   MALLOC_MMAP_THRESHOLD_=65536 target/release/examples/graph_ckpt_mem MODEL_DIR CKPT(0|1) BATCH SEQ
// (an example links the system allocator; the threshold makes freed tensors leave at once).
use candle_core::{DType, Device, Tensor};
use oxrl::model::graph_checkpoint::GraphCheckpoint;
use oxrl::model::Transformer;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (dir, ckpt, b, t) = (&args[1], args[2] == "1", args[3].parse::<usize>().unwrap(), args[4].parse::<usize>().unwrap());
    let mut m = Transformer::load(std::path::Path::new(dir), DType::F32, &Device::Cpu).unwrap();
    let vars = m.make_trainable().unwrap();
    let ids: Vec<Vec<u32>> = (0..b).map(|r| (0..t).map(|i| ((r * 7919 + i * 131) % 30000) as u32).collect()).collect();
    let pos: Vec<Vec<u32>> = (0..b).map(|_| (0..t as u32).collect()).collect();
    let mask: Vec<Vec<u8>> = (0..b).map(|_| vec![1u8; t]).collect();
    let base = oxrl::memory::resident_rss_gb();
    let start = std::time::Instant::now();
    let loss = |h: &Tensor| h.sqr().unwrap().sum_all().unwrap();
    let n = if ckpt {
        let (h, c) = GraphCheckpoint::forward(&m, &ids, &pos, &mask).unwrap();
        println!("after forward rss {:.3} peak {:.3}", oxrl::memory::resident_rss_gb(), oxrl::memory::peak_rss_gb());
        let store = loss(&h).backward().unwrap();
        let params: Vec<Tensor> = vars.iter().map(|(_, v)| v.as_tensor().clone()).collect();
        c.backward(&store, &params).unwrap().len()
    } else {
        let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
        println!("after forward rss {:.3} peak {:.3}", oxrl::memory::resident_rss_gb(), oxrl::memory::peak_rss_gb());
        let store = loss(&h).backward().unwrap();
        vars.iter().filter(|(_, v)| store.get(v.as_tensor()).is_some()).count()
    };
    println!("ckpt {ckpt} grads {n} rss_before {base:.3} peak {:.3} GB, {:.1} s", oxrl::memory::peak_rss_gb(), start.elapsed().as_secs_f64());
}
