//! Colocation frees memory: offloading a worker releases its parameter, gradient and optimizer
//! storage (live heap bytes do not grow although a host copy was made), and backloading
//! restores it bit-exactly. Live bytes are counted by this test binary's own allocator, so a
//! worker that kept its device tensors alive beside the host copy would fail here.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use candle_core::{DType, Device};
use common::{fixture_dir, loss};
use oxrl::dispatch::{Dispatch, WorkerSpec};
use oxrl::model::lora::LoraConfig;
use oxrl::model::Transformer;
use oxrl::worker::placement::HostCopy;
use oxrl::worker::{AdamParams, Datum, Worker, WorkerConfig};
use serde_json::json;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::SeqCst);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Tests of this binary run one at a time: live bytes are process-wide.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn live() -> isize {
    LIVE.load(Ordering::SeqCst)
}

fn batch() -> Vec<Datum> {
    (0..3)
        .map(|r| {
            let seq: Vec<u32> = (0..10).map(|i| ((r * 13 + i * 7) % 280) as u32 + 4).collect();
            let targets = seq[1..].iter().copied().chain([0]).collect();
            Datum::supervised(seq, targets, vec![0.1; 10])
        })
        .collect()
}

/// Every trainable parameter and both moments of each, flattened, in order.
fn state(w: &Worker) -> Vec<Vec<f32>> {
    let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut out = vec![];
    for (name, v) in w.params() {
        out.push(flat(v.as_tensor()));
        if let Some(m) = w.moments(name) {
            out.push(flat(&m.exp_avg));
            out.push(flat(&m.exp_avg_sq));
        }
    }
    out
}

#[test]
fn offload_releases_parameter_gradient_and_optimizer_storage_and_backload_is_bit_exact() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for lora in [None, Some(LoraConfig::new(8, 16.0, &["all-linear"]))] {
        let model = Transformer::load(&fixture_dir("qwen3"), DType::F32, &Device::Cpu).unwrap();
        let mut w = Worker::new(model, WorkerConfig { lora: lora.clone(), ..Default::default() }).unwrap();
        let ce = loss("cross_entropy", &json!({}));
        w.forward_backward(&batch(), Some(&ce), false).unwrap();
        w.optim_step(&AdamParams { learning_rate: 1e-2, ..Default::default() }).unwrap();
        // A pending gradient must survive the round trip too.
        w.forward_backward(&batch(), Some(&ce), false).unwrap();
        let resident = w.resident_bytes() as isize;
        let before_state = state(&w);
        let grads_before: Vec<Vec<f32>> =
            w.gradients().iter().map(|(_, g)| g.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
        // Parameters + gradients + two moments: 4× the parameter bytes.
        assert!(resident > 0);

        let mut host = HostCopy::default();
        let before = live();
        w.offload(true, true, &mut host).unwrap();
        let grown = live() - before;
        assert_eq!(w.resident_bytes(), 0, "lora={}: tensors left on the device", lora.is_some());
        // The host copy is new memory; the released device storage pays for it. Keeping the
        // device storage would make this `resident`.
        assert!(
            grown < resident / 10,
            "lora={}: offload grew live memory by {grown} bytes of {resident} resident: storage was kept",
            lora.is_some()
        );
        let err = w.forward_backward(&batch(), Some(&ce), false).unwrap_err().to_string();
        assert!(err.contains("offloaded"), "{err}");

        let before = live();
        w.backload(true, true, &mut host).unwrap();
        let grown = live() - before;
        assert!(grown < resident / 10, "backload grew live memory by {grown} bytes: the host copy was kept");
        assert_eq!(w.resident_bytes() as isize, resident);
        assert_eq!(state(&w), before_state, "backload is not bit-exact");
        let grads_after: Vec<Vec<f32>> =
            w.gradients().iter().map(|(_, g)| g.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
        assert_eq!(grads_after, grads_before);
        // And it trains on from there.
        w.optim_step(&AdamParams { learning_rate: 1e-2, ..Default::default() }).unwrap();
    }
}

#[test]
fn colocated_models_take_turns_and_the_idle_one_holds_nothing_on_the_device() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = Dispatch::new(true);
    let spec = WorkerSpec::new(fixture_dir("qwen3"));
    d.create_model("policy", &spec).unwrap();
    d.create_model("ref", &spec).unwrap();
    let resident = |id: &str| d.model(id).unwrap().inspect(|w| w.resident_bytes()).unwrap()[0];
    assert_eq!(resident("policy"), 0, "creating `ref` must offload `policy`");
    let ce = loss("cross_entropy", &json!({}));
    d.forward_backward("policy", &batch(), Some(&ce), false).unwrap();
    assert!(resident("policy") > 0);
    assert_eq!(resident("ref"), 0);
    let ref_out = d.forward("ref", &batch(), None, true).unwrap();
    assert_eq!(resident("policy"), 0, "running `ref` must offload `policy`");
    // The pending gradient survived the offload: the step uses it.
    let norm = d.optim_step("policy", &AdamParams::default()).unwrap();
    assert!(norm > 0.0, "the accumulated gradient was lost across the offload");
    assert_eq!(resident("ref"), 0);
    // Submitted back to back without waiting: the moves are queued, never raced.
    let a = d.submit_forward("ref", &batch(), None, true);
    let b = d.submit_forward_backward("policy", &batch(), Some(&ce), false);
    let c = d.submit_forward("ref", &batch(), None, true);
    assert_eq!(a.wait().unwrap().loss_fn_outputs, ref_out.loss_fn_outputs);
    b.wait().unwrap();
    assert_eq!(c.wait().unwrap().loss_fn_outputs, ref_out.loss_fn_outputs);
    assert_eq!(d.model("ref").unwrap().inspect(|w| w.is_offloaded()).unwrap(), vec![false]);
}
