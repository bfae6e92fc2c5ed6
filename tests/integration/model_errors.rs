//! Bad inputs give an `oxrl::Error` whose message names the file and the field or tensor at
//! fault, and never a panic: broken config.json, weights, sharded indexes, forward inputs and
//! LoRA adapters, each built in a temporary copy of a fixture model.

use crate::common;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::fixture_dir;
use oxrl::model::{lora, KvCache, Transformer};
use oxrl::Error;
use serde_json::{json, Value};
use tempfile::TempDir;

// ---------------------------------------------------------------- helpers

/// A temporary copy of the fixture's config.json and model.safetensors (and its LoRA adapter).
fn copy_fixture(arch: &str) -> TempDir {
    let src = fixture_dir(arch);
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    std::fs::create_dir(dir.path().join("lora")).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join("lora").join(f), dir.path().join("lora").join(f)).unwrap();
    }
    dir
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    edit_json(&dir.join("config.json"), edit)
}

fn edit_tensors(path: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let mut ts = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    edit(&mut ts);
    candle_core::safetensors::save(&ts, path).unwrap();
}

fn edit_weights(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    edit_tensors(&dir.join("model.safetensors"), edit)
}

/// Runs `f`, which must return an error (and not panic); gives the error.
fn expect_err<T>(what: &str, f: impl FnOnce() -> oxrl::Result<T>) -> Error {
    match catch_unwind(AssertUnwindSafe(f)) {
        Err(_) => panic!("{what}: panicked instead of returning an oxrl::Error"),
        Ok(Ok(_)) => panic!("{what}: succeeded, expected an error"),
        Ok(Err(e)) => e,
    }
}

fn load_err(dir: &Path) -> String {
    expect_err(&format!("loading {}", dir.display()), || Transformer::load(dir, DType::F32, &Device::Cpu)).to_string()
}

#[track_caller]
fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error message does not mention {p:?}:\n  {msg}");
    }
}

fn load(dir: &Path) -> Transformer {
    Transformer::load(dir, DType::F32, &Device::Cpu).unwrap()
}

fn path_str(p: PathBuf) -> String {
    p.display().to_string()
}

// ---------------------------------------------------------------- the copy itself loads

#[test]
fn unaltered_copy_loads() {
    let d = copy_fixture("qwen3");
    let m = load(d.path());
    assert_eq!(m.config.vocab_size, 300);
    let mut m = m;
    lora::load_peft(&mut m, &d.path().join("lora"), false).unwrap();
}

// ---------------------------------------------------------------- config.json

#[test]
fn config_missing_required_field() {
    for field in ["hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"] {
        let d = copy_fixture("qwen3");
        edit_config(d.path(), |c| {
            c.remove(field);
        });
        let msg = load_err(d.path());
        assert_mentions(&msg, &[&path_str(d.path().join("config.json")), field, "missing"]);
    }
    // null counts as missing.
    let d = copy_fixture("llama");
    edit_config(d.path(), |c| {
        c.insert("hidden_size".into(), Value::Null);
    });
    assert_mentions(&load_err(d.path()), &["config.json", "hidden_size", "missing"]);
}

#[test]
fn config_field_of_wrong_type() {
    let cases: [(&str, Value, &str); 7] = [
        ("hidden_size", json!("64"), "\"64\""),
        ("num_attention_heads", json!(4.5), "4.5"),
        ("num_key_value_heads", json!(-2), "-2"),
        ("rms_norm_eps", json!("small"), "small"),
        ("tie_word_embeddings", json!("yes"), "yes"),
        ("rope_scaling", json!(3), "3"),
        ("model_type", json!(["qwen3"]), "qwen3"),
    ];
    for (field, value, shown) in cases {
        let d = copy_fixture("qwen3");
        edit_config(d.path(), |c| {
            c.insert(field.into(), value.clone());
        });
        let msg = load_err(d.path());
        assert_mentions(&msg, &["config.json", field, shown]);
    }
}

#[test]
fn config_invalid_values() {
    let cases: [(&str, Value, &[&str]); 5] = [
        ("hidden_size", json!(0), &["hidden_size", "positive"]),
        ("num_key_value_heads", json!(3), &["num_key_value_heads", "3", "divide"]),
        ("head_dim", json!(15), &["head_dim", "15", "even"]),
        ("rms_norm_eps", json!(-1.0), &["rms_norm_eps", "positive"]),
        ("rope_theta", json!(0.0), &["rope_theta", "positive"]),
    ];
    for (field, value, parts) in cases {
        let d = copy_fixture("qwen3");
        edit_config(d.path(), |c| {
            c.insert(field.into(), value.clone());
        });
        let msg = load_err(d.path());
        assert_mentions(&msg, &["config.json"]);
        assert_mentions(&msg, parts);
    }
}

#[test]
fn config_unsupported_architecture() {
    let d = copy_fixture("qwen3");
    edit_config(d.path(), |c| {
        c.insert("model_type".into(), json!("gpt2"));
    });
    assert_mentions(&load_err(d.path()), &["config.json", "model_type", "gpt2", "unsupported"]);

    // Without model_type the architectures list decides, and is named.
    let d = copy_fixture("qwen3");
    edit_config(d.path(), |c| {
        c.remove("model_type");
        c.insert("architectures".into(), json!(["GPT2LMHeadModel"]));
    });
    assert_mentions(&load_err(d.path()), &["config.json", "architectures", "GPT2LMHeadModel"]);

    // Neither: the architecture is unknown.
    let d = copy_fixture("qwen3");
    edit_config(d.path(), |c| {
        c.remove("model_type");
        c.remove("architectures");
    });
    assert_mentions(&load_err(d.path()), &["config.json", "model_type", "missing"]);
}

#[test]
fn config_unsupported_features() {
    let cases: [(&str, Value, &[&str]); 6] = [
        ("hidden_act", json!("gelu"), &["hidden_act", "gelu"]),
        ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0}), &["rope_scaling", "yarn"]),
        ("rope_scaling", json!({"type": "dynamic", "factor": 2.0}), &["rope_scaling", "dynamic"]),
        ("use_sliding_window", json!(true), &["use_sliding_window"]),
        ("quantization_config", json!({"quant_method": "gptq"}), &["quantization_config"]),
        ("pretraining_tp", json!(2), &["pretraining_tp"]),
    ];
    for (field, value, parts) in cases {
        let d = copy_fixture("llama");
        edit_config(d.path(), |c| {
            c.insert(field.into(), value.clone());
        });
        let msg = load_err(d.path());
        assert_mentions(&msg, &["config.json"]);
        assert_mentions(&msg, parts);
    }
    // A llama3 rope scaling without one of its numbers names that number.
    let d = copy_fixture("llama");
    edit_config(d.path(), |c| {
        c.insert(
            "rope_scaling".into(),
            json!({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        );
    });
    assert_mentions(&load_err(d.path()), &["config.json", "rope_scaling.low_freq_factor"]);
}

#[test]
fn config_invalid_json_or_missing() {
    let d = copy_fixture("qwen3");
    std::fs::write(d.path().join("config.json"), "{\"model_type\": \"qwen3\", \"hidden_size\": 64,,}").unwrap();
    assert_mentions(&load_err(d.path()), &[&path_str(d.path().join("config.json")), "invalid JSON"]);

    let d = copy_fixture("qwen3");
    std::fs::write(d.path().join("config.json"), "[1, 2, 3]").unwrap();
    assert_mentions(&load_err(d.path()), &["config.json", "object"]);

    let d = copy_fixture("qwen3");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert_mentions(&load_err(d.path()), &[&path_str(d.path().join("config.json")), "cannot read"]);
}

// ---------------------------------------------------------------- model.safetensors

#[test]
fn weights_missing_tensor() {
    for (arch, name) in [
        ("qwen3", "model.layers.1.mlp.down_proj.weight"),
        ("qwen3", "model.layers.0.self_attn.q_norm.weight"),
        ("qwen2", "model.layers.0.self_attn.k_proj.bias"),
        ("llama", "model.norm.weight"),
    ] {
        let d = copy_fixture(arch);
        edit_weights(d.path(), |w| {
            assert!(w.remove(name).is_some(), "{arch}: fixture has no {name}");
        });
        let msg = load_err(d.path());
        assert_mentions(&msg, &[&path_str(d.path().join("model.safetensors")), name, "missing"]);
    }
    // An untied model needs lm_head.weight.
    let d = copy_fixture("llama");
    edit_config(d.path(), |c| {
        c.insert("tie_word_embeddings".into(), json!(false));
    });
    assert_mentions(&load_err(d.path()), &["model.safetensors", "lm_head.weight", "missing"]);
}

#[test]
fn weights_wrong_shape() {
    let d = copy_fixture("qwen3");
    let name = "model.layers.0.self_attn.k_proj.weight";
    edit_weights(d.path(), |w| {
        w.insert(name.into(), Tensor::zeros((32, 63), DType::F32, &Device::Cpu).unwrap());
    });
    assert_mentions(&load_err(d.path()), &["model.safetensors", name, "[32, 63]", "[32, 64]"]);

    // A config that disagrees with the weights: the first tensor it shapes is named.
    let d = copy_fixture("qwen3");
    edit_config(d.path(), |c| {
        c.insert("vocab_size".into(), json!(301));
    });
    assert_mentions(&load_err(d.path()), &["model.safetensors", "model.embed_tokens.weight", "[300, 64]", "[301, 64]"]);

    let d = copy_fixture("qwen3");
    edit_weights(d.path(), |w| {
        w.insert("model.norm.weight".into(), Tensor::ones((1, 64), DType::F32, &Device::Cpu).unwrap());
    });
    assert_mentions(&load_err(d.path()), &["model.norm.weight", "[1, 64]", "[64]"]);
}

#[test]
fn weights_unexpected_tensor() {
    let d = copy_fixture("qwen3");
    let extra = "model.layers.2.mlp.up_proj.weight";
    edit_weights(d.path(), |w| {
        w.insert(extra.into(), Tensor::zeros((128, 64), DType::F32, &Device::Cpu).unwrap());
    });
    assert_mentions(&load_err(d.path()), &["model.safetensors", extra, "unexpected"]);

    // A config with fewer layers than the checkpoint leaves layer 1 over.
    let d = copy_fixture("qwen2");
    edit_config(d.path(), |c| {
        c.insert("num_hidden_layers".into(), json!(1));
    });
    assert_mentions(&load_err(d.path()), &["model.safetensors", "model.layers.1.", "unexpected"]);

    // Buffers transformers itself ignores are allowed.
    let d = copy_fixture("qwen3");
    edit_weights(d.path(), |w| {
        w.insert(
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap(),
        );
    });
    load(d.path());
}

#[test]
fn weights_integer_dtype() {
    for (dtype, shown) in [(DType::I64, "I64"), (DType::U32, "U32"), (DType::U8, "U8")] {
        let d = copy_fixture("qwen3");
        let name = "model.layers.0.input_layernorm.weight";
        edit_weights(d.path(), |w| {
            w.insert(name.into(), Tensor::ones(64, dtype, &Device::Cpu).unwrap());
        });
        assert_mentions(&load_err(d.path()), &["model.safetensors", name, "dtype", shown]);
    }
}

#[test]
fn weights_in_half_precision_load() {
    let d = copy_fixture("qwen3");
    edit_weights(d.path(), |w| {
        for t in w.values_mut() {
            *t = t.to_dtype(DType::F16).unwrap();
        }
    });
    let m = load(d.path());
    assert_eq!(m.embed_tokens.dtype(), DType::F32);
}

#[test]
fn weights_corrupt_file() {
    let src = std::fs::read(fixture_dir("qwen3").join("model.safetensors")).unwrap();
    let cases: [(&str, Vec<u8>); 5] = [
        ("truncated in the data", src[..src.len() / 2].to_vec()),
        ("truncated in the header", src[..20].to_vec()),
        ("garbage", b"this is not a safetensors file, only some text".to_vec()),
        ("empty", vec![]),
        ("huge header length", [u64::MAX.to_le_bytes().to_vec(), b"{}".to_vec()].concat()),
    ];
    for (what, bytes) in cases {
        let d = copy_fixture("qwen3");
        let path = d.path().join("model.safetensors");
        std::fs::write(&path, bytes).unwrap();
        let msg = load_err(d.path());
        assert!(msg.contains(&path_str(path.clone())), "{what}: {msg}");
        assert!(msg.contains("safetensors"), "{what}: {msg}");
    }
}

#[test]
fn weights_file_missing() {
    let d = copy_fixture("qwen3");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert_mentions(
        &load_err(d.path()),
        &[&path_str(d.path().to_path_buf()), "model.safetensors", "model.safetensors.index.json"],
    );

    // A missing model directory names config.json in it.
    let missing = d.path().join("no-such-model");
    assert_mentions(&load_err(&missing), &[&path_str(missing.join("config.json"))]);
}

// ---------------------------------------------------------------- sharded checkpoints

/// Splits the fixture's weights into two shards with an index; returns the dir, the shard
/// names and which shard each tensor went to.
fn sharded_copy(arch: &str) -> (TempDir, HashMap<String, String>) {
    let d = copy_fixture(arch);
    let single = d.path().join("model.safetensors");
    let all = candle_core::safetensors::load(&single, &Device::Cpu).unwrap();
    std::fs::remove_file(&single).unwrap();
    let mut names: Vec<_> = all.keys().cloned().collect();
    names.sort();
    let mut map = HashMap::new();
    for (k, chunk) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        let part: HashMap<String, Tensor> = chunk.iter().map(|n| (n.clone(), all[n].clone())).collect();
        candle_core::safetensors::save(&part, d.path().join(&file)).unwrap();
        for n in chunk {
            map.insert(n.clone(), file.clone());
        }
    }
    write_index(d.path(), &map);
    (d, map)
}

fn write_index(dir: &Path, map: &HashMap<String, String>) {
    std::fs::write(dir.join("model.safetensors.index.json"), json!({"metadata": {}, "weight_map": map}).to_string())
        .unwrap();
}

#[test]
fn sharded_copy_loads() {
    let (d, map) = sharded_copy("qwen3");
    assert!(map.values().any(|f| f.contains("00002")));
    load(d.path());
}

#[test]
fn sharded_index_names_missing_shard() {
    let (d, mut map) = sharded_copy("qwen3");
    let name = "model.layers.1.mlp.up_proj.weight";
    map.insert(name.into(), "model-00003-of-00002.safetensors".into());
    write_index(d.path(), &map);
    assert_mentions(
        &load_err(d.path()),
        &[
            &path_str(d.path().join("model-00003-of-00002.safetensors")),
            "no such file",
            "model.safetensors.index.json",
            name,
        ],
    );

    // A shard file deleted from disk.
    let (d, map) = sharded_copy("qwen3");
    let shard = map["model.norm.weight"].clone();
    std::fs::remove_file(d.path().join(&shard)).unwrap();
    assert_mentions(&load_err(d.path()), &[&path_str(d.path().join(&shard)), "no such file"]);
}

#[test]
fn sharded_index_names_tensor_absent_from_its_shard() {
    let (d, mut map) = sharded_copy("qwen3");
    let name = "model.layers.0.mlp.gate_proj.weight";
    let first = map[name].clone();
    let other = map.values().find(|f| **f != first).unwrap().clone();
    map.insert(name.into(), other.clone());
    write_index(d.path(), &map);
    assert_mentions(&load_err(d.path()), &[&path_str(d.path().join(&other)), name, "model.safetensors.index.json"]);
}

#[test]
fn sharded_index_without_a_needed_tensor() {
    let (d, mut map) = sharded_copy("llama");
    let name = "model.layers.1.self_attn.v_proj.weight";
    map.remove(name);
    write_index(d.path(), &map);
    assert_mentions(&load_err(d.path()), &["model.safetensors.index.json", name, "missing"]);
}

#[test]
fn sharded_index_malformed() {
    let (d, _) = sharded_copy("qwen3");
    let index = d.path().join("model.safetensors.index.json");
    std::fs::write(&index, "{\"weight_map\": ").unwrap();
    assert_mentions(&load_err(d.path()), &[&path_str(index.clone()), "invalid JSON"]);

    std::fs::write(&index, "{\"metadata\": {}}").unwrap();
    assert_mentions(&load_err(d.path()), &[&path_str(index.clone()), "weight_map"]);

    std::fs::write(&index, "{\"weight_map\": {\"model.norm.weight\": 7}}").unwrap();
    assert_mentions(&load_err(d.path()), &[&path_str(index.clone()), "weight_map.model.norm.weight"]);
}

#[test]
fn sharded_shard_with_integer_tensor() {
    let (d, map) = sharded_copy("qwen3");
    let name = "model.norm.weight";
    let shard = d.path().join(&map[name]);
    edit_tensors(&shard, |w| {
        w.insert(name.into(), Tensor::zeros(64, DType::I64, &Device::Cpu).unwrap());
    });
    assert_mentions(&load_err(d.path()), &[&path_str(shard), name, "dtype"]);
}

// ---------------------------------------------------------------- Transformer::forward inputs

fn fixture_model() -> Transformer {
    load(&fixture_dir("qwen3"))
}

/// A forward of one row.
fn forward1(m: &Transformer, ids: &[u32], pos: &[u32], mask: &[u8]) -> oxrl::Result<Tensor> {
    m.forward(&[ids.to_vec()], &[pos.to_vec()], &[mask.to_vec()], None)
}

fn row(n: usize) -> (Vec<u32>, Vec<u32>, Vec<u8>) {
    ((0..n as u32).map(|i| 5 + i).collect(), (0..n as u32).collect(), vec![1; n])
}

#[test]
fn forward_token_id_out_of_range() {
    let m = fixture_model();
    let (mut ids, pos, mask) = row(4);
    ids[2] = 300;
    let e = expect_err("id 300", || forward1(&m, &ids, &pos, &mask));
    assert_mentions(&e.to_string(), &["token id 300", "vocab_size 300", "position 2"]);
    ids[2] = u32::MAX;
    let e = expect_err("id u32::MAX", || forward1(&m, &ids, &pos, &mask));
    assert_mentions(&e.to_string(), &[&u32::MAX.to_string(), "vocab_size 300"]);
    // The last valid id is fine.
    ids[2] = 299;
    m.forward(&[ids], &[pos], &[mask], None).unwrap();
}

#[test]
fn forward_position_beyond_max_position_embeddings() {
    let m = fixture_model();
    assert_eq!(m.config.max_position_embeddings, 256);
    let (ids, mut pos, mask) = row(3);
    pos[2] = 256;
    let e = expect_err("position 256", || forward1(&m, &ids, &pos, &mask));
    assert_mentions(&e.to_string(), &["256", "max_position_embeddings"]);
    pos[2] = 255;
    m.forward(&[ids], &[pos], &[mask], None).unwrap();
}

#[test]
fn forward_mismatched_lengths() {
    let m = fixture_model();
    let (a_ids, a_pos, a_mask) = row(4);
    let (b_ids, b_pos, b_mask) = row(3);
    let (ids, pos, mask) = ([a_ids.clone(), b_ids], [a_pos.clone(), b_pos.clone()], [a_mask.clone(), b_mask.clone()]);
    let e = expect_err("ragged ids", || m.forward(&ids, &pos, &mask, None));
    assert_mentions(&e.to_string(), &["row 1", "length 4"]);

    let e = expect_err("positions row short", || forward1(&m, &a_ids, &b_pos, &a_mask));
    assert_mentions(&e.to_string(), &["row 0", "positions"]);

    let e = expect_err("mask row short", || forward1(&m, &a_ids, &a_pos, &b_mask));
    assert_mentions(&e.to_string(), &["row 0", "mask"]);

    let (ids, mask) = ([a_ids.clone(), a_ids.clone()], [a_mask.clone(), a_mask.clone()]);
    let e = expect_err("too few position rows", || m.forward(&ids, std::slice::from_ref(&a_pos), &mask, None));
    assert_mentions(&e.to_string(), &["positions has 1 rows", "input_ids has 2"]);

    let e = expect_err("empty batch", || m.forward(&[], &[], &[], None));
    assert_mentions(&e.to_string(), &["empty batch"]);
}

#[test]
fn forward_empty_rows() {
    let m = fixture_model();
    let e = expect_err("a [1, 0] batch", || m.forward(&[vec![]], &[vec![]], &[vec![]], None));
    assert_mentions(&e.to_string(), &["input_ids", "empty", "length 0"]);
}

#[test]
fn forward_cache_row_mismatch() {
    let m = fixture_model();
    let (ids, pos, mask) = row(3);
    let mut cache: KvCache = m.new_cache();
    m.forward(&[ids.clone(), ids], &[pos.clone(), pos], &[mask.clone(), mask], Some(&mut cache)).unwrap();
    let e =
        expect_err("cache of 2 rows, batch of 1", || m.forward(&[vec![7]], &[vec![3]], &[vec![1]], Some(&mut cache)));
    assert_mentions(&e.to_string(), &["cache holds 2 rows", "batch has 1"]);
}

// ---------------------------------------------------------------- LoRA adapters

fn lora_err(d: &TempDir) -> String {
    let mut m = load(d.path());
    let dir = d.path().join("lora");
    expect_err("loading the adapter", || lora::load_peft(&mut m, &dir, false)).to_string()
}

fn adapter_file(d: &TempDir) -> String {
    path_str(d.path().join("lora").join("adapter_model.safetensors"))
}

fn adapter_config(d: &TempDir) -> String {
    path_str(d.path().join("lora").join("adapter_config.json"))
}

#[test]
fn lora_missing_tensor() {
    let d = copy_fixture("qwen3");
    let name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight";
    edit_tensors(&d.path().join("lora/adapter_model.safetensors"), |w| {
        assert!(w.remove(name).is_some());
    });
    assert_mentions(&lora_err(&d), &[&adapter_file(&d), name, "missing"]);
}

#[test]
fn lora_wrong_shape() {
    let d = copy_fixture("llama");
    let name = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight";
    edit_tensors(&d.path().join("lora/adapter_model.safetensors"), |w| {
        w.insert(name.into(), Tensor::zeros((128, 5), DType::F32, &Device::Cpu).unwrap());
    });
    assert_mentions(&lora_err(&d), &[&adapter_file(&d), name, "[128, 5]", "[128, 4]"]);

    // A rank in the config that disagrees with the tensors.
    let d = copy_fixture("llama");
    edit_json(&d.path().join("lora/adapter_config.json"), |c| {
        c.insert("r".into(), json!(8));
    });
    assert_mentions(&lora_err(&d), &[&adapter_file(&d), "lora_A.weight", "[4, 64]", "[8, 64]"]);
}

#[test]
fn lora_unexpected_tensor() {
    // Targets no longer include up_proj: its tensors are left over.
    let d = copy_fixture("qwen3");
    edit_json(&d.path().join("lora/adapter_config.json"), |c| {
        c.insert("target_modules".into(), json!(["q_proj", "v_proj"]));
    });
    assert_mentions(&lora_err(&d), &[&adapter_file(&d), "up_proj", "unexpected"]);
}

#[test]
fn lora_integer_tensor() {
    let d = copy_fixture("qwen3");
    let name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    edit_tensors(&d.path().join("lora/adapter_model.safetensors"), |w| {
        w.insert(name.into(), Tensor::zeros((4, 64), DType::U32, &Device::Cpu).unwrap());
    });
    assert_mentions(&lora_err(&d), &[&adapter_file(&d), name, "dtype"]);
}

#[test]
fn lora_config_errors() {
    let cases: [(&str, Value, &[&str]); 9] = [
        ("target_modules", json!(["q_proj", "foo_proj"]), &["target_modules", "foo_proj"]),
        ("target_modules", json!(".*proj"), &["target_modules", ".*proj"]),
        ("use_dora", json!(true), &["use_dora"]),
        ("rank_pattern", json!({"q_proj": 8}), &["rank_pattern"]),
        ("modules_to_save", json!(["lm_head"]), &["modules_to_save"]),
        ("bias", json!("all"), &["bias", "all"]),
        ("peft_type", json!("IA3"), &["peft_type", "IA3"]),
        ("r", json!("four"), &["`r`"]),
        ("lora_alpha", Value::Null, &["lora_alpha"]),
    ];
    for (field, value, parts) in cases {
        let d = copy_fixture("qwen3");
        edit_json(&d.path().join("lora/adapter_config.json"), |c| {
            c.insert(field.into(), value.clone());
        });
        let msg = lora_err(&d);
        assert_mentions(&msg, &[&adapter_config(&d)]);
        assert_mentions(&msg, parts);
    }
    // r = 0.
    let d = copy_fixture("qwen3");
    edit_json(&d.path().join("lora/adapter_config.json"), |c| {
        c.insert("r".into(), json!(0));
    });
    assert_mentions(&lora_err(&d), &[&adapter_config(&d), "rank"]);
}

#[test]
fn lora_files_missing_or_corrupt() {
    let d = copy_fixture("qwen3");
    std::fs::remove_file(d.path().join("lora/adapter_config.json")).unwrap();
    assert_mentions(&lora_err(&d), &[&adapter_config(&d), "cannot read"]);

    let d = copy_fixture("qwen3");
    std::fs::write(d.path().join("lora/adapter_config.json"), "{ r: 4 }").unwrap();
    assert_mentions(&lora_err(&d), &[&adapter_config(&d), "invalid JSON"]);

    let d = copy_fixture("qwen3");
    std::fs::remove_file(d.path().join("lora/adapter_model.safetensors")).unwrap();
    assert_mentions(&lora_err(&d), &[&adapter_file(&d)]);

    let d = copy_fixture("qwen3");
    std::fs::write(d.path().join("lora/adapter_model.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": ")
        .unwrap();
    assert_mentions(&lora_err(&d), &[&adapter_file(&d), "safetensors"]);
}

#[test]
fn sliding_attention_layers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture_dir("qwen3").join("config.json")).unwrap())
            .unwrap();
    cfg["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"]);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let err = oxrl::model::ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("config.json") && err.contains("layer_types") && err.contains("sliding_attention"), "{err}");
}

#[test]
fn token_ids_are_checked_by_one_function_with_one_message() {
    use oxrl::model::check_token_ids;
    assert!(check_token_ids(&[0, 299, 5], 300, "x").is_ok());
    assert!(check_token_ids(&[], 0, "x").is_ok());
    let e = check_token_ids(&[1, 300, 301], 300, format_args!("datum {}: input_tokens", 4)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: datum 4: input_tokens: token id 300 at position 1 is out of range for vocab_size 300"
    );
}

#[test]
fn json_fields_read_typed_values_and_name_the_file_and_field() {
    use oxrl::files::JsonFields;
    let path = Path::new("dir/x.json");
    let v = json!({"n": 3, "x": 0.5, "s": "a", "b": true, "ids": [1, 2], "id": 7, "null": null, "neg": -1});
    let f = JsonFields::new(path, &v).unwrap();
    assert_eq!(
        (f.u64("n").unwrap(), f.usize("n").unwrap(), f.f64("x").unwrap(), f.f64("n").unwrap()),
        (3, 3, 0.5, 3.0)
    );
    assert_eq!(
        (f.str("s").unwrap(), f.bool_or("b", false).unwrap(), f.bool_or("null", true).unwrap()),
        ("a", true, true)
    );
    assert_eq!(
        (f.token_ids("ids").unwrap(), f.token_ids("id").unwrap(), f.token_ids("null").unwrap()),
        (vec![1, 2], vec![7], vec![])
    );
    assert_eq!(
        (f.opt_u64("null").unwrap(), f.opt_str("absent").unwrap(), f.opt_f64("absent").unwrap()),
        (None, None, None)
    );
    let err = |e: oxrl::Error| e.to_string();
    assert_eq!(err(f.u64("null").unwrap_err()), "dir/x.json: field `null`: missing (required)");
    assert_eq!(err(f.u64("neg").unwrap_err()), "dir/x.json: field `neg`: expected a non-negative integer, got -1");
    assert_eq!(err(f.f64("s").unwrap_err()), "dir/x.json: field `s`: expected a finite number, got \"a\"");
    assert_eq!(err(f.str("n").unwrap_err()), "dir/x.json: field `n`: expected a string, got 3");
    assert_eq!(err(f.bool_or("n", false).unwrap_err()), "dir/x.json: field `n`: expected true or false, got 3");
    assert_eq!(
        err(f.token_ids("neg").unwrap_err()),
        "dir/x.json: field `neg`: expected a token id (a non-negative 32-bit integer), got -1"
    );
    assert_eq!(err(JsonFields::new(path, &json!([1])).err().unwrap()), "dir/x.json: expected a JSON object");
}
