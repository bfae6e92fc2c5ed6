//! `NamedTensors` (take, leftovers, dtype conversion, files) and the weight-update snapshots.

use crate::common;

use candle_core::{DType, Device, Tensor};
use common::*;
use oxrl::model::lora::{self, LoraConfig};
use oxrl::model::weight_update::WeightUpdate;
use oxrl::model::{NamedTensors, Transformer};

fn t(shape: &[usize], start: f32) -> Tensor {
    let n: usize = shape.iter().product();
    // Values with many mantissa bits, so that a lossy round trip would show.
    let v: Vec<f32> = (0..n).map(|i| start + (i as f32) * 0.123_456_79 - 1.0 / 3.0).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

fn set() -> NamedTensors {
    NamedTensors::from_vec("my source", vec![("b".into(), t(&[2, 3], 0.0)), ("a".into(), t(&[4], 1.0))]).unwrap()
}

#[test]
fn take_checks_name_and_shape_and_converts_dtype() {
    let mut s = set();
    assert_eq!(s.names().collect::<Vec<_>>(), ["a", "b"], "ordered by name");
    assert_eq!((s.len(), s.contains("a"), s.get("a").map(|t| t.dims().to_vec())), (2, true, Some(vec![4])));

    let err = s.take("c", &[4], DType::F32).unwrap_err().to_string();
    assert!(err.contains("my source") && err.contains("`c`") && err.contains("missing"), "{err}");
    let err = s.take("b", &[3, 2], DType::F32).unwrap_err().to_string();
    assert!(
        err.contains("my source") && err.contains("`b`") && err.contains("[2, 3]") && err.contains("[3, 2]"),
        "{err}"
    );

    let a = s.take("a", &[4], DType::BF16).unwrap();
    assert_eq!(a.dtype(), DType::BF16);
    let want = values(&t(&[4], 1.0).to_dtype(DType::BF16).unwrap());
    assert_eq!(values(&a), want);
    assert!(!s.contains("a"), "take removes the tensor");
}

#[test]
fn a_name_given_twice_is_an_error() {
    let mut s = set();
    let err = s.insert("a", t(&[1], 0.0)).unwrap_err().to_string();
    assert!(err.contains("`a`") && err.contains("twice"), "{err}");
    let err = s.extend(set()).unwrap_err().to_string();
    assert!(err.contains("twice"), "{err}");
}

#[test]
fn leftovers_are_rejected_by_name_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (dir.path().join("one.safetensors"), dir.path().join("two.safetensors"));
    set().save_file(&one).unwrap();
    NamedTensors::from_vec("x", vec![("c".into(), t(&[1], 0.0)), ("d".into(), t(&[1], 0.0))])
        .unwrap()
        .save_file(&two)
        .unwrap();
    let mut s = NamedTensors::new(dir.path());
    s.extend(NamedTensors::load_file(&one, &Device::Cpu).unwrap()).unwrap();
    s.extend(NamedTensors::load_file(&two, &Device::Cpu).unwrap()).unwrap();
    assert_eq!(s.path_of("d"), Some(two.as_path()));

    // Missing: named against the set's source (the directory).
    let err = s.take("e", &[1], DType::F32).unwrap_err().to_string();
    assert!(err.contains(&dir.path().display().to_string()) && err.contains("`e`"), "{err}");

    s.take("a", &[4], DType::F32).unwrap();
    s.take("b", &[2, 3], DType::F32).unwrap();
    // The first unexpected one by name, with its own file.
    let err = s.reject_leftovers(|_| false, "not wanted here").unwrap_err().to_string();
    assert!(err.contains(&two.display().to_string()) && err.contains("`c`"), "{err}");
    assert!(err.contains("unexpected tensor: not wanted here"), "{err}");
    let err = s.reject_leftovers(|n| n == "c", "not wanted here").unwrap_err().to_string();
    assert!(err.contains("`d`"), "{err}");
    s.reject_leftovers(|n| n == "c" || n == "d", "not wanted here").unwrap();
    s.take("c", &[1], DType::F32).unwrap();
    s.take("d", &[1], DType::F32).unwrap();
    assert!(s.is_empty());
    s.reject_leftovers(|_| false, "not wanted here").unwrap();
}

#[test]
fn save_then_load_is_bit_exact_in_every_float_dtype() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let s = set().to_dtype(dtype).unwrap();
        let path = dir.path().join(format!("{dtype:?}.safetensors"));
        s.save_file(&path).unwrap();
        assert!(!path.with_extension("safetensors.tmp").exists(), "the temporary file is renamed away");
        let back = NamedTensors::load_file(&path, &Device::Cpu).unwrap();
        assert_eq!(back.source(), path.as_path());
        assert_eq!(back.names().collect::<Vec<_>>(), s.names().collect::<Vec<_>>());
        for ((_, a), (_, b)) in s.iter().zip(&back) {
            assert_eq!((a.dtype(), a.dims()), (b.dtype(), b.dims()));
            assert_eq!(values(a), values(b), "{dtype:?}");
        }
    }
}

#[test]
fn bad_files_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.safetensors");
    let err = NamedTensors::load_file(&path, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("nope.safetensors") && err.contains("no such file"), "{err}");
    std::fs::write(&path, b"garbage").unwrap();
    let err = NamedTensors::load_file(&path, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("nope.safetensors") && err.contains("not a valid safetensors"), "{err}");
    let err = NamedTensors::load_dir(dir.path(), &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("neither"), "{err}");
}

fn load(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

fn params_values(m: &Transformer) -> Vec<(String, Vec<f64>)> {
    m.named_params().iter().map(|(n, t)| (n.clone(), values(t))).collect()
}

#[test]
fn snapshots_are_fresh_storage() {
    let mut trainer = load("qwen3");
    let vars = trainer.make_trainable().unwrap();
    let before = params_values(&trainer);
    let snap = WeightUpdate::full_snapshot(&trainer).unwrap();
    for (_, v) in &vars {
        v.set(&v.as_tensor().ones_like().unwrap()).unwrap();
    }
    let WeightUpdate::Full(tensors) = &snap else { unreachable!() };
    assert_eq!(tensors.len(), before.len());
    for ((name, want), (n, got)) in before.iter().zip(tensors) {
        assert_eq!((name.as_str(), want), (n, &values(got)), "the snapshot moved with the variable");
    }

    let cfg = LoraConfig::new(2, 4.0, &["q_proj", "up_proj"]);
    let mut trainer = load("qwen3");
    let vars = lora::attach_new(&mut trainer, &cfg, 3).unwrap();
    let snap = WeightUpdate::lora_snapshot(&trainer, &cfg).unwrap();
    let WeightUpdate::Lora { tensors, config } = &snap else { unreachable!() };
    assert_eq!((config, tensors.len()), (&cfg, vars.len()));
    let a_before: Vec<_> = vars.iter().map(|(_, v)| values(v.as_tensor())).collect();
    for (_, v) in &vars {
        v.set(&v.as_tensor().ones_like().unwrap()).unwrap();
    }
    for ((name, _), want) in vars.iter().zip(a_before) {
        assert_eq!(values(tensors.get(name).unwrap()), want, "{name}: the snapshot moved with the variable");
    }
    // Applied to a base model it gives the adapters of the snapshot.
    let applied = snap.apply(&load("qwen3")).unwrap();
    let got = lora::adapter_tensors(&applied).unwrap();
    assert_eq!(got.names().collect::<Vec<_>>(), tensors.names().collect::<Vec<_>>());
    for ((_, a), (_, b)) in got.iter().zip(tensors) {
        assert_eq!(values(a), values(b));
    }
}

#[test]
fn a_bad_update_is_refused_whole_and_names_the_tensor() {
    let m = load("llama");
    let before = params_values(&m);
    let mut params = m.named_params();
    // A good tensor first (by name) and a wrong-shaped one later: nothing may be applied.
    let last = params.len() - 1;
    params[last].1 = params[last].1.narrow(0, 0, 1).unwrap();
    let bad_name = params[last].0.clone();
    let update = WeightUpdate::Full(NamedTensors::from_vec("weight update", params).unwrap());
    let err = update.apply(&m).unwrap_err().to_string();
    assert!(err.contains("weight update") && err.contains(&bad_name) && err.contains("shape"), "{err}");
    assert_eq!(params_values(&m), before);

    // A converted dtype is applied in the model's dtype.
    let bf16 = WeightUpdate::Full(
        NamedTensors::from_vec("weight update", m.named_params()).unwrap().to_dtype(DType::BF16).unwrap(),
    );
    let applied = bf16.apply(&m).unwrap();
    assert!(applied.named_params().iter().all(|(_, t)| t.dtype() == DType::F32));
}
